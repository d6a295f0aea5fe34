"""Load-aware picks: the engines' waiting requests and KV cache usage, and pools (no I/O; prefix affinity: test_affinity.py)."""

import pytest

from router.config import RouterConfig
from router.tests.conftest import MODEL, make_table, new_picker


def picker_with(*endpoints, **options):
    picker = new_picker(**options)
    picker.routes.apply_table(make_table(endpoints))
    return picker


def urls(picker, count, **kwargs):
    """The replicas `count` picks land on, each released before the next (so only engine load differs)."""
    picked = []
    for _ in range(count):
        endpoint = picker.pick(MODEL, **kwargs)
        picked.append(endpoint.url)
        picker.release(endpoint)
    return picked


def test_an_engines_waiting_requests_count_as_load():
    picker = picker_with("http://a:1", "http://b:1")
    a, b = picker.routes.endpoints(MODEL)
    picker.record_engine_load(a, 3, 0.1)
    assert urls(picker, 4) == ["http://b:1"] * 4
    # Three waiting at the engine weigh as three outstanding here: b takes three more before a is next.
    held = [picker.pick(MODEL) for _ in range(3)]
    assert [e.url for e in held] == ["http://b:1"] * 3
    assert sorted(urls(picker, 2)) == ["http://a:1", "http://b:1"]


def test_waiting_requests_are_weighed_per_unit_of_weight():
    picker = picker_with({"url": "http://a:1", "weight": 4}, {"url": "http://b:1", "weight": 1})
    a, b = picker.routes.endpoints(MODEL)
    picker.record_engine_load(a, 3, None)  # a: 3 / 4 = 0.75
    assert picker.pick(MODEL) is b  # b: 0 -> 1
    assert picker.pick(MODEL) is a  # 0.75 < 1 (unweighted, 3 waiting would lose to b's 1)


def test_a_replica_with_its_kv_cache_nearly_full_is_skipped():
    picker = picker_with("http://a:1", "http://b:1", kv_full_fraction=0.9)
    a, b = picker.routes.endpoints(MODEL)
    picker.record_engine_load(a, 0, 0.9)  # at the fraction counts as full
    picker.record_engine_load(b, 0, 0.5)
    held = [picker.pick(MODEL) for _ in range(5)]
    assert held == [b] * 5  # even though b is far busier
    picker.record_engine_load(a, 0, 0.89)
    assert picker.pick(MODEL) is a


def test_a_full_replica_is_passed_over_even_at_a_higher_priority():
    picker = picker_with({"url": "http://a:1", "priority": 5}, {"url": "http://b:1", "priority": 0})
    a, b = picker.routes.endpoints(MODEL)
    picker.record_engine_load(a, 0, 0.99)
    assert urls(picker, 2) == ["http://b:1"] * 2


def test_when_every_replica_is_kv_full_the_least_loaded_is_taken():
    picker = picker_with("http://a:1", "http://b:1", "http://c:1")
    a, b, c = picker.routes.endpoints(MODEL)
    for endpoint, waiting in ((a, 5), (b, 1), (c, 3)):
        picker.record_engine_load(endpoint, waiting, 1.0)
    assert urls(picker, 3) == ["http://b:1"] * 3


def test_unknown_engine_load_is_neutral_neither_busy_nor_full():
    picker = picker_with("http://a:1", "http://b:1")
    a, b = picker.routes.endpoints(MODEL)
    picker.record_engine_load(a, 2, 0.99)
    picker.record_engine_load(a, None, None)  # the engine stopped answering its /metrics
    assert (a.queued, a.kv_full, a.engine_waiting, a.kv_usage) == (0.0, False, None, None)
    assert urls(picker, 4) == ["http://a:1", "http://b:1"] * 2  # plain turns, as with no engine figures


def test_pools_restrict_the_candidates():
    picker = picker_with(
        {"url": "http://a:1", "pool": "gold"}, {"url": "http://b:1", "pool": "default"}, {"url": "http://c:1"}
    )
    assert set(urls(picker, 6, pools=frozenset({"gold"}))) == {"http://a:1"}
    assert set(urls(picker, 6, pools=frozenset({"default"}))) == {"http://b:1", "http://c:1"}
    assert picker.pick(MODEL, pools=frozenset({"silver"})) is None
    assert set(urls(picker, 6)) == {"http://a:1", "http://b:1", "http://c:1"}  # None: any pool


def test_pools_and_exclude_combine():
    picker = picker_with({"url": "http://a:1", "pool": "gold"}, {"url": "http://b:1", "pool": "gold"})
    a, b = picker.routes.endpoints(MODEL)
    assert picker.pick(MODEL, [a], pools=frozenset({"gold"})) is b
    assert picker.pick(MODEL, [a, b], pools=frozenset({"gold"})) is None


def test_engine_figures_survive_a_table_update_that_keeps_the_replica():
    picker = picker_with("http://a:1")
    (a,) = picker.routes.endpoints(MODEL)
    picker.record_engine_load(a, 4, 0.5)
    picker.routes.apply_table(make_table(["http://a:1", "http://b:1"], fingerprint="grown"))
    assert picker.routes.endpoints(MODEL)[0] is a and (a.engine_waiting, a.kv_usage) == (4, 0.5)
    assert picker.routes.endpoints(MODEL)[1].engine_waiting is None


def test_bad_balancing_options_are_refused():
    with pytest.raises(ValueError, match="kv_full_fraction"):
        new_picker(kv_full_fraction=0)
    with pytest.raises(ValueError, match="affinity_slack"):
        new_picker(affinity_slack=-1)


def test_picker_options_come_from_the_settings(settings):
    settings.LLMGW_KV_CACHE_FULL_FRACTION = 0.8
    settings.LLMGW_PREFIX_AFFINITY_SLACK = 2
    config = RouterConfig.from_settings()
    assert (config.kv_full_fraction, config.affinity_slack) == (0.8, 2.0)
