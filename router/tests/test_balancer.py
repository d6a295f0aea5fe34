"""Replica choice, name resolution and last-use stamps of the router's Balancer (no I/O)."""

import pytest

from router.balancer import Balancer, TableError

from .conftest import ALIAS, MODEL, make_table


def balancer_with(*endpoints, clock=None):
    balancer = Balancer(clock=clock) if clock else Balancer()
    balancer.apply_table(make_table(endpoints))
    return balancer


def test_pick_prefers_the_highest_priority_even_when_it_is_busier():
    balancer = balancer_with({"url": "http://a:1", "priority": 0}, {"url": "http://b:1", "priority": 5})
    picks = [balancer.pick(MODEL).url for _ in range(4)]
    assert picks == ["http://b:1"] * 4


def test_pick_spreads_by_outstanding_requests_per_weight():
    balancer = balancer_with({"url": "http://a:1", "weight": 1}, {"url": "http://b:1", "weight": 3})
    picks = [balancer.pick(MODEL).url for _ in range(8)]
    # Weight 3 carries three times the outstanding requests of weight 1.
    assert picks.count("http://b:1") == 6
    assert picks.count("http://a:1") == 2


def test_released_replica_is_preferred_again():
    balancer = balancer_with("http://a:1", "http://b:1")
    first = balancer.pick(MODEL)
    second = balancer.pick(MODEL)
    assert {first.url, second.url} == {"http://a:1", "http://b:1"}
    balancer.release(first)
    assert balancer.pick(MODEL) is first


def test_ties_are_taken_in_turn():
    balancer = balancer_with("http://a:1", "http://b:1", "http://c:1")
    picks = []
    for _ in range(6):
        endpoint = balancer.pick(MODEL)
        picks.append(endpoint.url)
        balancer.release(endpoint)
    assert picks == ["http://a:1", "http://b:1", "http://c:1"] * 2


def test_pick_excludes_replicas_already_tried():
    balancer = balancer_with("http://a:1", "http://b:1")
    assert balancer.pick(MODEL, exclude=["1"]).replica_id == "2"
    assert balancer.pick(MODEL, exclude=["1", "2"]) is None


def test_pick_stamps_last_use_of_the_chosen_replica_only():
    now = [1000.0]
    balancer = balancer_with("http://a:1", "http://b:1", clock=lambda: now[0])
    chosen = balancer.pick(MODEL)
    assert balancer.pending_stamps() == {chosen.replica_id: 1000.0}
    now[0] = 1005.0
    balancer.release(chosen)
    again = balancer.pick(MODEL)
    assert balancer.take_stamps() == {chosen.replica_id: 1000.0, again.replica_id: 1005.0}
    assert balancer.pending_stamps() == {}


def test_a_replica_serving_a_long_request_is_stamped_at_every_flush_until_it_ends():
    now = [1000.0]
    balancer = balancer_with("http://a:1", clock=lambda: now[0])
    streaming = balancer.pick(MODEL)
    assert balancer.take_stamps() == {"1": 1000.0}
    now[0] = 1300.0
    assert balancer.take_stamps() == {"1": 1300.0}
    balancer.release(streaming)
    now[0] = 1600.0
    assert balancer.take_stamps() == {}


def test_restored_stamps_do_not_overwrite_newer_ones():
    balancer = Balancer()
    balancer.restore_stamps({"1": 10.0, "2": 30.0})
    balancer.restore_stamps({"1": 20.0, "2": 5.0})
    assert balancer.pending_stamps() == {"1": 20.0, "2": 30.0}


def test_outstanding_requests_survive_a_table_update_for_the_same_replica():
    balancer = balancer_with("http://a:1", "http://b:1")
    busy = balancer.pick(MODEL)
    table = make_table(["http://a:1", "http://b:1"])
    table["endpoints"][0]["pool"] = "batch"
    table["fingerprint"] = "changed"
    assert balancer.apply_table(table)
    assert balancer.in_flight() == 1
    # The idle one is chosen next, because the busy one still counts its request.
    assert balancer.pick(MODEL) is not busy


def test_same_fingerprint_is_not_applied_twice():
    balancer = Balancer()
    table = {**make_table(["http://a:1"]), "fingerprint": "f1"}
    assert balancer.apply_table(table)
    assert not balancer.apply_table(table)


def test_alias_resolves_to_the_public_name_and_unknown_names_do_not():
    balancer = balancer_with("http://a:1")
    assert balancer.resolve(ALIAS) == MODEL
    assert balancer.resolve(MODEL) == MODEL
    assert balancer.resolve("gpt-4") is None


def test_a_public_name_wins_over_an_alias_that_clashes_with_it():
    balancer = Balancer()
    balancer.apply_table({"models": {"a": {"aliases": ["b"]}, "b": {"aliases": []}}, "endpoints": []})
    assert balancer.resolve("b") == "b"


def test_malformed_endpoint_rows_are_skipped_and_the_rest_kept():
    balancer = Balancer()
    table = make_table(["http://a:1"])
    table["endpoints"] += [
        {"replica_id": "9", "model": MODEL},
        {"replica_id": "8", "model": MODEL, "url": "x"},
        {"replica_id": "7", "model": MODEL, "url": "http://c:1", "weight": 0},
    ]
    balancer.apply_table(table)
    assert [e.replica_id for e in balancer.endpoints(MODEL)] == ["1"]


def test_endpoints_of_models_not_in_the_catalog_are_ignored():
    balancer = Balancer()
    balancer.apply_table(make_table([{"url": "http://a:1", "model": "disabled"}]))
    assert balancer.endpoints() == []


def test_a_table_that_is_not_an_object_is_refused_by_name():
    with pytest.raises(TableError, match="not an object"):
        Balancer().apply_table(["endpoints"])
