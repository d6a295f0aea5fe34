"""Prefix affinity (router.picking.affinity, router.picking.choice): prompts as chained block hashes, and each turn of a
conversation sent where its earlier turns' KV cache is, within the load slack (no I/O)."""

import os
import subprocess
import sys

import pytest

from router.picking.affinity import BLOCK_BYTES, MAX_BLOCKS, PrefixMemory, prefix_affinity
from router.tests.conftest import MODEL, PROJECT, make_table, new_picker

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
REPLICAS = ("http://a:1", "http://b:1", "http://c:1", "http://d:1")


def picker_with(*endpoints, **options):
    picker = new_picker(**options)
    picker.routes.apply_table(make_table(endpoints))
    return picker


def conversation(number: int, turns: int) -> list[list[dict]]:
    """The message lists of a chat's turns: each turn repeats the last one's messages, its answer and a question."""
    messages = [SYSTEM, {"role": "user", "content": f"Conversation {number}: tell me about topic {number}."}]
    asked = [list(messages)]
    for turn in range(1, turns):
        messages += [
            {"role": "assistant", "content": f"Here is what I know about topic {number}, part {turn}. " * 4},
            {"role": "user", "content": f"And then, for turn {turn}?"},
        ]
        asked.append(list(messages))
    return asked


def pick_and_release(picker, messages):
    endpoint = picker.pick(MODEL, affinity=prefix_affinity({"messages": messages}))
    picker.release(endpoint)
    return endpoint.url


# -- the chain ---------------------------------------------------------------------------------------


def test_a_later_turns_chain_begins_with_every_block_of_the_earlier_turns():
    first, second, third = (prefix_affinity({"messages": m}) for m in conversation(1, 3))
    assert second.blocks[: len(first.blocks)] == first.blocks
    assert third.blocks[: len(second.blocks)] == second.blocks
    assert len(first.blocks) < len(second.blocks) < len(third.blocks)
    # The conversation key: the opening (system prompt and first question), the same for every turn.
    assert first.key == second.key == third.key == first.blocks[-1]


def test_blocks_follow_messages_and_fixed_sizes():
    long = "x" * (BLOCK_BYTES * 2 + 10)
    prefix = prefix_affinity({"messages": [SYSTEM, {"role": "user", "content": long}]})
    # One block for the short system prompt, three for the long question (its role and NUL included).
    assert len(prefix.blocks) == 1 + 3
    # Where one message ends and the next begins, and who speaks, are part of the prompt.
    split = prefix_affinity({"messages": [{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}]})
    other = prefix_affinity({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "bc"}]})
    assert split.blocks[-1] != other.blocks[-1]
    as_system = prefix_affinity({"messages": [{"role": "system", "content": "ab"}]})
    assert as_system.blocks != prefix_affinity({"messages": [{"role": "user", "content": "ab"}]}).blocks


def test_conversations_that_share_a_system_prompt_have_keys_of_their_own():
    keys = {prefix_affinity({"messages": conversation(n, 1)[0]}).key for n in range(50)}
    assert len(keys) == 50
    # Only a system prompt: the key is its end.
    only = prefix_affinity({"messages": [SYSTEM]})
    assert only.key == only.blocks[-1]


def test_at_most_max_blocks_are_hashed():
    huge = prefix_affinity({"prompt": "y" * BLOCK_BYTES * (MAX_BLOCKS + 50)})
    assert len(huge.blocks) == MAX_BLOCKS
    assert huge == prefix_affinity({"prompt": "y" * BLOCK_BYTES * (MAX_BLOCKS + 60)})


def test_completion_prompts_as_text_batches_and_token_ids_have_prefixes():
    assert prefix_affinity({"prompt": ["first", "second"]}) == prefix_affinity({"prompt": "first"})
    assert prefix_affinity({"prompt": [1, 2, 3]}) == prefix_affinity({"prompt": [[1, 2, 3]]})
    assert prefix_affinity({"prompt": [1, 2, 3]}) != prefix_affinity({"prompt": [1, 2, 4]})
    # A completion continued: same first block, same key.
    head = "z" * BLOCK_BYTES
    assert prefix_affinity({"prompt": head + "one"}).key == prefix_affinity({"prompt": head + "two more"}).key


def test_chat_content_parts_count_their_text_only():
    parts = [{"type": "text", "text": "You are terse."}, {"type": "image_url", "image_url": {"url": "x"}}]
    assert prefix_affinity({"messages": [{"role": "system", "content": parts}]}) == prefix_affinity(
        {"messages": [{"role": "system", "content": "You are terse."}]}
    )


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
def test_requests_without_prompt_text_have_no_prefix(payload):
    assert prefix_affinity(payload) is None


# -- the picks ---------------------------------------------------------------------------------------


def test_every_turn_of_a_conversation_goes_where_its_first_went():
    picker = picker_with(*REPLICAS)
    chats = [conversation(n, 4) for n in range(24)]
    landed: dict[int, set[str]] = {n: set() for n in range(24)}
    for turn in range(4):  # interleaved, as conversations are
        for n, chat in enumerate(chats):
            landed[n].add(pick_and_release(picker, chat[turn]))
    assert all(len(replicas) == 1 for replicas in landed.values())
    # ... and the conversations spread over the replicas.
    assert len(set().union(*landed.values())) == 4


def test_a_turn_follows_the_replica_its_last_turn_went_to_when_the_slack_moved_it():
    picker = picker_with("http://a:1", "http://b:1", affinity_slack=0)
    first, second, third = conversation(7, 3)
    home = picker.pick(MODEL, affinity=prefix_affinity({"messages": first}))
    picker.release(home)
    other = next(e for e in picker.routes.endpoints(MODEL) if e is not home)
    # Home is busy: the second turn goes to the other replica, and now its cache is the longest there ...
    busy = picker.pick(MODEL, [other])
    assert busy is home
    assert picker.pick(MODEL, affinity=prefix_affinity({"messages": second})) is other
    picker.release(other)
    picker.release(busy)
    # ... so the third turn follows it there, although its conversation key still prefers home.
    assert picker.pick(MODEL, affinity=prefix_affinity({"messages": third})) is other


def test_affinity_holds_within_the_slack_and_moves_beyond_it():
    picker = picker_with("http://a:1", "http://b:1", affinity_slack=2)
    prefix = prefix_affinity({"prompt": "shared system prompt"})
    first = picker.pick(MODEL, affinity=prefix)
    other = next(e for e in picker.routes.endpoints(MODEL) if e is not first)
    # The preferred replica keeps the prefix while it is at most 2 requests busier than the other ...
    assert picker.pick(MODEL, affinity=prefix) is first
    assert picker.pick(MODEL, affinity=prefix) is first
    assert (first.outstanding, other.outstanding) == (3, 0)
    # ... and beyond that the request goes to the least loaded.
    assert picker.pick(MODEL, affinity=prefix) is other
    # The engine's own queue counts toward the slack too (the prefix now last went to `other`).
    for _ in range(3):
        picker.release(first)
    picker.release(other)
    picker.record_engine_load(other, 2, None)  # 2 waiting vs nothing: within the slack
    assert picker.pick(MODEL, affinity=prefix) is other
    picker.release(other)
    picker.record_engine_load(other, 3, None)  # 3 vs nothing: beyond it
    assert picker.pick(MODEL, affinity=prefix) is first


def test_affinity_never_sends_a_request_to_a_kv_full_replica():
    picker = picker_with("http://a:1", "http://b:1")
    prefix = prefix_affinity({"prompt": "shared system prompt"})
    preferred = picker.pick(MODEL, affinity=prefix)
    picker.release(preferred)
    picker.record_engine_load(preferred, 0, 0.99)
    assert picker.pick(MODEL, affinity=prefix) is not preferred


def test_every_router_prefers_the_same_replica_for_a_conversation():
    """Two processes with different str hash seeds (two routers) derive the same prefix and replica."""
    script = (
        "import msgspec\n"
        "from hub.contracts import EndpointTable\n"
        "from router.picking.affinity import prefix_affinity\n"
        "from router.accounting.ledger import Ledger\n"
        "from router.endpoints.routes import RouteTable\n"
        "from router.picking.picker import Picker\n"
        "routes = RouteTable()\n"
        "b = Picker(routes, Ledger(routes))\n"
        "b.routes.apply_table(msgspec.convert({'models': {'m': {}}, 'endpoints': [\n"
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


# -- the memory --------------------------------------------------------------------------------------


def test_the_memory_is_bounded_and_found_from_a_prompts_end():
    memory = PrefixMemory(limit=8)
    old, new = prefix_affinity({"prompt": "o" * BLOCK_BYTES * 6}), prefix_affinity({"prompt": "n" * BLOCK_BYTES * 6})
    memory.remember(MODEL, old, "r1")
    memory.remember(MODEL, new, "r2")  # 12 blocks > 8: the oldest half (old's first six) forgotten
    assert memory.last_replica(MODEL, old) is None
    assert memory.last_replica(MODEL, new) == "r2"
    longer = prefix_affinity({"prompt": "n" * BLOCK_BYTES * 9})
    assert memory.last_replica(MODEL, longer) == "r2"  # its first six blocks are new's


def test_a_model_gone_from_the_table_is_forgotten():
    picker = picker_with(*REPLICAS[:2])
    pick_and_release(picker, conversation(1, 1)[0])
    assert picker.prefixes.last_replica(MODEL, prefix_affinity({"messages": conversation(1, 1)[0]})) is not None
    others = [{"url": f"http://o:{i}", "model": "other"} for i in (1, 2)]
    picker.routes.apply_table(make_table(others, models={"other": {}}, fingerprint="gone"))
    # Forgotten by the next pick that remembers a prefix, whichever model it is for.
    picker.release(picker.pick("other", affinity=prefix_affinity({"messages": conversation(2, 1)[0]})))
    assert picker.prefixes.last_replica(MODEL, prefix_affinity({"messages": conversation(1, 1)[0]})) is None


def test_a_prefix_is_only_worth_hashing_where_there_is_a_choice_of_replicas():
    picker = picker_with(*REPLICAS[:1])
    assert not picker.routes.has_choice(MODEL) and not picker.routes.has_choice("unknown")
    picker.routes.apply_table(make_table(REPLICAS[:2], fingerprint="two"))
    assert picker.routes.has_choice(MODEL)
