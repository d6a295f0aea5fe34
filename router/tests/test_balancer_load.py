"""Load-aware picks: the engines' waiting requests and KV cache usage, prefix affinity and pools (no I/O)."""

import os
import subprocess
import sys

import pytest

from router.affinity import PREFIX_CHARS, prefix_affinity
from router.balancer import Balancer
from router.config import RouterConfig

from .conftest import MODEL, PROJECT, make_table


def balancer_with(*endpoints, **options):
    balancer = Balancer(**options)
    balancer.apply_table(make_table(endpoints))
    return balancer


def urls(balancer, count, **kwargs):
    """The replicas `count` picks land on, each released before the next (so only engine load differs)."""
    picked = []
    for _ in range(count):
        endpoint = balancer.pick(MODEL, **kwargs)
        picked.append(endpoint.url)
        balancer.release(endpoint)
    return picked


def test_an_engines_waiting_requests_count_as_load():
    balancer = balancer_with("http://a:1", "http://b:1")
    a, b = balancer.endpoints(MODEL)
    balancer.record_engine_load(a, 3, 0.1)
    assert urls(balancer, 4) == ["http://b:1"] * 4
    # Three waiting at the engine weigh as three outstanding here: b takes three more before a is next.
    held = [balancer.pick(MODEL) for _ in range(3)]
    assert [e.url for e in held] == ["http://b:1"] * 3
    assert sorted(urls(balancer, 2)) == ["http://a:1", "http://b:1"]


def test_waiting_requests_are_weighed_per_unit_of_weight():
    balancer = balancer_with({"url": "http://a:1", "weight": 4}, {"url": "http://b:1", "weight": 1})
    a, b = balancer.endpoints(MODEL)
    balancer.record_engine_load(a, 3, None)  # a: 3 / 4 = 0.75
    assert balancer.pick(MODEL) is b  # b: 0 -> 1
    assert balancer.pick(MODEL) is a  # 0.75 < 1 (unweighted, 3 waiting would lose to b's 1)


def test_a_replica_with_its_kv_cache_nearly_full_is_skipped():
    balancer = balancer_with("http://a:1", "http://b:1", kv_full_fraction=0.9)
    a, b = balancer.endpoints(MODEL)
    balancer.record_engine_load(a, 0, 0.9)  # at the fraction counts as full
    balancer.record_engine_load(b, 0, 0.5)
    held = [balancer.pick(MODEL) for _ in range(5)]
    assert held == [b] * 5  # even though b is far busier
    balancer.record_engine_load(a, 0, 0.89)
    assert balancer.pick(MODEL) is a


def test_a_full_replica_is_passed_over_even_at_a_higher_priority():
    balancer = balancer_with({"url": "http://a:1", "priority": 5}, {"url": "http://b:1", "priority": 0})
    a, b = balancer.endpoints(MODEL)
    balancer.record_engine_load(a, 0, 0.99)
    assert urls(balancer, 2) == ["http://b:1"] * 2


def test_when_every_replica_is_kv_full_the_least_loaded_is_taken():
    balancer = balancer_with("http://a:1", "http://b:1", "http://c:1")
    a, b, c = balancer.endpoints(MODEL)
    for endpoint, waiting in ((a, 5), (b, 1), (c, 3)):
        balancer.record_engine_load(endpoint, waiting, 1.0)
    assert urls(balancer, 3) == ["http://b:1"] * 3


def test_unknown_engine_load_is_neutral_neither_busy_nor_full():
    balancer = balancer_with("http://a:1", "http://b:1")
    a, b = balancer.endpoints(MODEL)
    balancer.record_engine_load(a, 2, 0.99)
    balancer.record_engine_load(a, None, None)  # the engine stopped answering its /metrics
    assert (a.queued, a.kv_full, a.engine_waiting, a.kv_usage) == (0.0, False, None, None)
    assert urls(balancer, 4) == ["http://a:1", "http://b:1"] * 2  # plain turns, as with no engine figures


def test_same_affinity_key_sticks_to_one_replica_across_idle_picks():
    balancer = balancer_with("http://a:1", "http://b:1", "http://c:1", "http://d:1")
    for prompt in ("You are a helpful assistant.", "Translate to French:", "Summarise this:"):
        key = prefix_affinity({"messages": [{"role": "system", "content": prompt}]})
        assert len(set(urls(balancer, 6, affinity=key))) == 1


def test_different_affinity_keys_spread_over_the_replicas():
    balancer = balancer_with("http://a:1", "http://b:1", "http://c:1", "http://d:1")
    chosen = set()
    for i in range(64):
        endpoint = balancer.pick(MODEL, affinity=prefix_affinity({"prompt": f"document {i}: "}))
        chosen.add(endpoint.url)
        balancer.release(endpoint)
    assert len(chosen) == 4


def test_affinity_holds_within_the_slack_and_moves_beyond_it():
    balancer = balancer_with("http://a:1", "http://b:1", affinity_slack=2)
    key = prefix_affinity({"prompt": "shared system prompt"})
    first = balancer.pick(MODEL, affinity=key)
    other = next(e for e in balancer.endpoints(MODEL) if e is not first)
    # The preferred replica keeps the key while it is at most 2 requests busier than the other ...
    assert balancer.pick(MODEL, affinity=key) is first
    assert balancer.pick(MODEL, affinity=key) is first
    assert (first.outstanding, other.outstanding) == (3, 0)
    # ... and beyond that the request goes to the least loaded.
    assert balancer.pick(MODEL, affinity=key) is other
    # The engine's own queue counts toward the slack too.
    for _ in range(3):
        balancer.release(first)
    balancer.record_engine_load(first, 3, None)  # 3 waiting vs the other's 1 outstanding: within the slack
    assert balancer.pick(MODEL, affinity=key) is first
    balancer.release(first)
    balancer.record_engine_load(first, 4, None)  # 4 vs 1: beyond it
    assert balancer.pick(MODEL, affinity=key) is other


def test_affinity_never_sends_a_request_to_a_kv_full_replica():
    balancer = balancer_with("http://a:1", "http://b:1")
    key = prefix_affinity({"prompt": "shared system prompt"})
    preferred = balancer.pick(MODEL, affinity=key)
    balancer.release(preferred)
    balancer.record_engine_load(preferred, 0, 0.99)
    assert balancer.pick(MODEL, affinity=key) is not preferred


def test_every_router_prefers_the_same_replica_for_a_prompt():
    """Two processes with different str hash seeds (two routers) derive the same key and replica."""
    script = (
        "import msgspec\n"
        "from hub.contracts import EndpointTable\n"
        "from router.affinity import prefix_affinity\n"
        "from router.balancer import Balancer\n"
        "b = Balancer()\n"
        "b.apply_table(msgspec.convert({'models': {'m': {}}, 'endpoints': [\n"
        "    {'replica_id': str(i), 'model': 'm', 'url': f'http://h:{i}'} for i in range(1, 9)]}, EndpointTable))\n"
        "keys = [prefix_affinity({'messages': [{'role': 'user', 'content': f'prompt {i}'}]}) for i in range(20)]\n"
        "print(keys, [b.pick('m', affinity=k).replica_id for k in keys])\n"
    )
    outputs = set()
    for seed in ("1", "2", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", script], cwd=PROJECT, env=env, capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 0, result.stderr
        outputs.add(result.stdout)
    assert len(outputs) == 1


def test_pools_restrict_the_candidates():
    balancer = balancer_with(
        {"url": "http://a:1", "pool": "gold"}, {"url": "http://b:1", "pool": "default"}, {"url": "http://c:1"}
    )
    assert set(urls(balancer, 6, pools=frozenset({"gold"}))) == {"http://a:1"}
    assert set(urls(balancer, 6, pools=frozenset({"default"}))) == {"http://b:1", "http://c:1"}
    assert balancer.pick(MODEL, pools=frozenset({"silver"})) is None
    assert set(urls(balancer, 6)) == {"http://a:1", "http://b:1", "http://c:1"}  # None: any pool


def test_pools_and_exclude_combine():
    balancer = balancer_with({"url": "http://a:1", "pool": "gold"}, {"url": "http://b:1", "pool": "gold"})
    a, b = balancer.endpoints(MODEL)
    assert balancer.pick(MODEL, [a], pools=frozenset({"gold"})) is b
    assert balancer.pick(MODEL, [a, b], pools=frozenset({"gold"})) is None


def test_engine_figures_survive_a_table_update_that_keeps_the_replica():
    balancer = balancer_with("http://a:1")
    (a,) = balancer.endpoints(MODEL)
    balancer.record_engine_load(a, 4, 0.5)
    balancer.apply_table(make_table(["http://a:1", "http://b:1"], fingerprint="grown"))
    assert balancer.endpoints(MODEL)[0] is a and (a.engine_waiting, a.kv_usage) == (4, 0.5)
    assert balancer.endpoints(MODEL)[1].engine_waiting is None


def test_bad_balancing_options_are_refused():
    with pytest.raises(ValueError, match="kv_full_fraction"):
        Balancer(kv_full_fraction=0)
    with pytest.raises(ValueError, match="affinity_slack"):
        Balancer(affinity_slack=-1)


def test_balancer_options_come_from_the_settings(settings):
    settings.LLMGW_KV_CACHE_FULL_FRACTION = 0.8
    settings.LLMGW_PREFIX_AFFINITY_SLACK = 2
    config = RouterConfig.from_settings()
    assert (config.kv_full_fraction, config.affinity_slack) == (0.8, 2.0)


# -- affinity keys ---------------------------------------------------------------------------------


def test_chat_affinity_key_is_the_first_messages_contents():
    system = {"role": "system", "content": "You are terse."}
    key = prefix_affinity({"messages": [system, {"role": "user", "content": "What is 2+2?"}]})
    assert key == prefix_affinity({"messages": [system, {"role": "user", "content": "What is 2+2?"}]})
    assert key != prefix_affinity({"messages": [system, {"role": "user", "content": "What is 3+3?"}]})
    parts = [{"type": "text", "text": "You are terse."}, {"type": "image_url", "image_url": {"url": "x"}}]
    assert prefix_affinity({"messages": [{"role": "system", "content": parts}]}) == prefix_affinity(
        {"messages": [{"role": "system", "content": "You are terse."}]}
    )


def test_affinity_key_looks_only_at_the_prefix():
    head = "x" * PREFIX_CHARS
    assert prefix_affinity({"prompt": head + "one"}) == prefix_affinity({"prompt": head + "two"})
    long_system = {"role": "system", "content": head}
    assert prefix_affinity({"messages": [long_system, {"role": "user", "content": "a"}]}) == prefix_affinity(
        {"messages": [long_system, {"role": "user", "content": "b"}]}
    )


def test_completion_prompts_as_text_batches_and_token_ids_have_keys():
    assert prefix_affinity({"prompt": ["first", "second"]}) == prefix_affinity({"prompt": "first"})
    assert prefix_affinity({"prompt": [1, 2, 3]}) == prefix_affinity({"prompt": [[1, 2, 3]]})
    assert prefix_affinity({"prompt": [1, 2, 3]}) != prefix_affinity({"prompt": [1, 2, 4]})


@pytest.mark.parametrize(
    "payload",
    [
        {"input": "embed me"},
        {"messages": []},
        {"messages": ["not an object", {"role": "user"}, {"role": "user", "content": None}]},
        {"prompt": ""},
        {"prompt": [{"odd": 1}]},
        {"prompt": 42},
    ],
)
def test_requests_without_prompt_text_have_no_affinity_key(payload):
    assert prefix_affinity(payload) is None
