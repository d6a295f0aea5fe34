"""Replica choice, outlier ejection, name resolution and last-use stamps of the router's Balancer (no I/O)."""

import json

import pytest

from router.endpoints.table import TableError, decode_table
from router.metrics import RouterMetrics
from router.picking.balancer import Balancer, EjectionPolicy, Failure
from router.tests.conftest import (
    ALIAS,
    MODEL,
    Clock,
    in_flight_by_model,
    make_table,
    pending_stamps,
    table_of,
    table_rows,
)


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
    first, second = balancer.endpoints(MODEL)
    assert balancer.pick(MODEL, exclude=[first]).replica_id == "2"
    assert balancer.pick(MODEL, exclude=[first, second]) is None


def test_a_replica_placed_again_on_a_new_url_is_not_excluded_by_its_old_endpoint():
    """The control plane keeps a replica's id when it re-places it; the endpoint (URL) is new."""
    balancer = balancer_with("http://a:1")
    (old,) = balancer.endpoints(MODEL)
    balancer.apply_table(make_table(["http://a:2"], fingerprint="placed again"))
    (new,) = balancer.endpoints(MODEL)
    assert (new.replica_id, new.url) == (old.replica_id, "http://a:2")
    assert balancer.pick(MODEL, exclude=[old]) is new


def test_pick_stamps_last_use_of_the_chosen_replica_only():
    now = [1000.0]
    balancer = balancer_with("http://a:1", "http://b:1", clock=lambda: now[0])
    chosen = balancer.pick(MODEL)
    assert pending_stamps(balancer) == {chosen.replica_id: 1000.0}
    now[0] = 1005.0
    balancer.release(chosen)
    again = balancer.pick(MODEL)
    assert balancer.take_usage()[0] == {chosen.replica_id: 1000.0, again.replica_id: 1005.0}
    assert pending_stamps(balancer) == {}


def test_a_replica_serving_a_long_request_is_stamped_at_every_flush_until_it_ends():
    now = [1000.0]
    balancer = balancer_with("http://a:1", clock=lambda: now[0])
    streaming = balancer.pick(MODEL)
    assert balancer.take_usage()[0] == {"1": 1000.0}
    now[0] = 1300.0
    assert balancer.take_usage()[0] == {"1": 1300.0}
    balancer.release(streaming)
    now[0] = 1600.0
    assert balancer.take_usage()[0] == {}


OTHER = "qwen"


def two_model_balancer():
    balancer = Balancer()
    table = table_rows(["http://a:1", "http://b:1"], models={MODEL: {"aliases": []}, OTHER: {"aliases": []}})
    table["endpoints"].append({"replica_id": "3", "model": OTHER, "url": "http://c:1"})
    balancer.apply_table(table_of(table))
    return balancer


def test_in_flight_peaks_are_counted_per_model_and_taken_with_the_stamps():
    balancer = two_model_balancer()
    first, second, third = (balancer.pick(MODEL) for _ in range(3))
    other = balancer.pick(OTHER)
    balancer.release(first)
    assert in_flight_by_model(balancer) == {MODEL: 2, OTHER: 1}
    stamps, peaks = balancer.take_usage()
    assert peaks == {MODEL: 3, OTHER: 1}
    assert set(stamps) == {"1", "2", "3"}
    for endpoint in (second, third, other):
        balancer.release(endpoint)
    assert in_flight_by_model(balancer) == {}


def test_a_peak_between_two_takes_survives_even_when_its_requests_ended_before_the_take():
    balancer = two_model_balancer()
    quick = [balancer.pick(MODEL) for _ in range(4)]
    for endpoint in quick:
        balancer.release(endpoint, Failure.CONNECT if endpoint is quick[0] else None)
    assert balancer.take_usage()[1] == {MODEL: 4}
    assert balancer.take_usage()[1] == {}  # nothing in flight: the next window starts empty


def test_the_next_peak_window_starts_at_what_is_in_flight_at_the_take():
    balancer = two_model_balancer()
    long_running = [balancer.pick(MODEL) for _ in range(2)]
    balancer.release(balancer.pick(MODEL))
    assert balancer.take_usage()[1] == {MODEL: 3}
    # Two requests still streaming: they count in the next window even if nothing new arrives.
    assert balancer.take_usage()[1] == {MODEL: 2}
    balancer.release(long_running[0])
    extra = balancer.pick(OTHER)
    assert balancer.take_usage()[1] == {MODEL: 2, OTHER: 1}
    assert balancer.take_usage()[1] == {MODEL: 1, OTHER: 1}
    balancer.release(long_running[1])
    balancer.release(extra)
    assert balancer.take_usage()[1] == {MODEL: 1, OTHER: 1}
    assert balancer.take_usage()[1] == {}


def test_in_flight_follows_the_model_of_the_replica_across_table_updates():
    balancer = two_model_balancer()
    busy = balancer.pick(MODEL)
    balancer.apply_table(make_table([], models={MODEL: {"aliases": []}}, fingerprint="all gone"))
    assert in_flight_by_model(balancer) == {MODEL: 1}
    balancer.release(busy)  # its replica left the table while the request ran
    assert in_flight_by_model(balancer) == {}


def test_restored_stamps_do_not_overwrite_newer_ones():
    balancer = Balancer()
    balancer.restore_stamps({"1": 10.0, "2": 30.0})
    balancer.restore_stamps({"1": 20.0, "2": 5.0})
    assert pending_stamps(balancer) == {"1": 20.0, "2": 30.0}


def test_outstanding_requests_survive_a_table_update_for_the_same_replica():
    balancer = balancer_with("http://a:1", "http://b:1")
    busy = balancer.pick(MODEL)
    table = make_table([{"url": "http://a:1", "pool": "batch"}, "http://b:1"], fingerprint="changed")
    assert balancer.apply_table(table)
    assert balancer.in_flight() == 1
    # The idle one is chosen next, because the busy one still counts its request.
    assert balancer.pick(MODEL) is not busy


def test_same_fingerprint_is_not_applied_twice():
    balancer = Balancer()
    table = make_table(["http://a:1"], fingerprint="f1")
    assert balancer.apply_table(table)
    assert not balancer.apply_table(table)


def test_alias_resolves_to_the_public_name_and_unknown_names_do_not():
    balancer = balancer_with("http://a:1")
    assert balancer.resolve(ALIAS) == MODEL
    assert balancer.resolve(MODEL) == MODEL
    assert balancer.resolve("gpt-4") is None


def test_a_public_name_wins_over_an_alias_that_clashes_with_it():
    balancer = Balancer()
    balancer.apply_table(table_of({"models": {"a": {"aliases": ["b"]}, "b": {"aliases": []}}, "endpoints": []}))
    assert balancer.resolve("b") == "b"


def test_malformed_endpoint_rows_are_skipped_and_the_rest_kept():
    balancer = Balancer()
    table = table_rows(["http://a:1"])
    table["endpoints"] += [
        {"replica_id": "9", "model": MODEL},
        {"replica_id": "8", "model": MODEL, "url": "x"},
        {"replica_id": "7", "model": MODEL, "url": "http://c:1", "weight": 0},
    ]
    balancer.apply_table(decode_table(json.dumps(table).encode()))
    assert [e.replica_id for e in balancer.endpoints(MODEL)] == ["1"]


def test_endpoints_of_models_not_in_the_catalog_are_ignored():
    balancer = Balancer()
    balancer.apply_table(make_table([{"url": "http://a:1", "model": "disabled"}]))
    assert balancer.endpoints() == []


def test_a_table_that_is_not_an_object_is_refused_by_name():
    with pytest.raises(TableError, match="not an object"):
        decode_table(b'["endpoints"]')


# -- outlier ejection ------------------------------------------------------------------------------


def ejecting_balancer(*urls, clock, **policy):
    """Replicas "1", "2" … in order of preference (descending priority), so each pick is predictable."""
    balancer = Balancer(ejection_clock=clock, ejection=EjectionPolicy(**policy))
    balancer.apply_table(preferred_in_order(*urls))
    return balancer


def preferred_in_order(*urls, fingerprint="", weights=()):
    rows = [{"url": url, "priority": len(urls) - i} for i, url in enumerate(urls)]
    for row, weight in zip(rows, weights, strict=False):
        row["weight"] = weight
    return make_table(rows, fingerprint=fingerprint)


def fail(balancer, replica_id, failure=Failure.CONNECT):
    """One request to `replica_id` that fails before its response (as the proxy reports it)."""
    endpoint = next(e for e in balancer.endpoints() if e.replica_id == replica_id)
    endpoint.outstanding += 1  # as a pick would have counted it
    balancer.release(endpoint, failure)


def serve(balancer, replica_id):
    """One request to `replica_id` that gets an answer below 500."""
    endpoint = next(e for e in balancer.endpoints() if e.replica_id == replica_id)
    endpoint.outstanding += 1
    balancer.succeeded(endpoint)
    balancer.release(endpoint)


def picks(balancer, count=6):
    """The replica ids of `count` picks, each released at once."""
    chosen = []
    for _ in range(count):
        endpoint = balancer.pick(MODEL)
        chosen.append(endpoint.replica_id)
        balancer.release(endpoint)
    return chosen


def ejected_ids(balancer):
    return sorted(e.replica_id for e in balancer.ejected())


def test_a_replica_refusing_a_connection_is_ejected_at_the_first_failure():
    clock = Clock()
    balancer = ejecting_balancer("http://a:1", "http://b:1", clock=clock)
    fail(balancer, "1", Failure.CONNECT)
    assert ejected_ids(balancer) == ["1"]
    assert picks(balancer) == ["2"] * 6
    assert balancer.ejection_counts() == {MODEL: 1}


@pytest.mark.parametrize("failure", [Failure.ERROR, Failure.LOST])
def test_three_consecutive_5xx_or_lost_connections_eject_and_a_success_between_them_resets_the_count(failure):
    clock = Clock()
    balancer = ejecting_balancer("http://a:1", "http://b:1", clock=clock)
    fail(balancer, "1", failure)
    fail(balancer, "1", failure)
    serve(balancer, "1")
    fail(balancer, "1", failure)
    fail(balancer, "1", failure)
    assert ejected_ids(balancer) == []
    assert picks(balancer) == ["1"] * 6
    fail(balancer, "1", failure)
    assert ejected_ids(balancer) == ["1"]
    assert picks(balancer) == ["2"] * 6


def test_a_refused_connection_after_two_5xx_ejects():
    balancer = ejecting_balancer("http://a:1", "http://b:1", clock=Clock())
    fail(balancer, "1", Failure.ERROR)
    fail(balancer, "1", Failure.ERROR)
    fail(balancer, "1", Failure.CONNECT)
    assert ejected_ids(balancer) == ["1"]


def test_the_cool_down_doubles_with_each_failed_probe_up_to_the_cap_and_resets_after_a_success():
    clock = Clock()
    balancer = ejecting_balancer("http://a:1", "http://b:1", clock=clock)
    fail(balancer, "1")
    for cooldown in (1, 2, 4, 8, 16, 30, 30, 30):
        ejected_at = clock.now
        clock.now = ejected_at + cooldown - 0.001
        assert picks(balancer, 3) == ["2"] * 3
        clock.now = ejected_at + cooldown
        probe = balancer.pick(MODEL)  # half-open: the preferred replica gets its probe
        assert probe.replica_id == "1"
        balancer.release(probe, Failure.CONNECT)  # the probe fails: out again, for longer

    clock.now += 30
    probe = balancer.pick(MODEL)
    assert probe.replica_id == "1"
    balancer.succeeded(probe)
    balancer.release(probe)
    assert ejected_ids(balancer) == []
    # A success resets the streak: the next ejection is the first one again.
    fail(balancer, "1")
    clock.now += 0.999
    assert picks(balancer, 4) == ["2"] * 4
    clock.now += 0.002
    assert balancer.pick(MODEL).replica_id == "1"


def test_a_half_open_replica_gets_exactly_one_probe_and_is_back_when_it_succeeds():
    clock = Clock()
    balancer = ejecting_balancer("http://a:1", "http://b:1", clock=clock)
    fail(balancer, "1")
    clock.now += 1.0
    probe = balancer.pick(MODEL)
    assert probe.replica_id == "1"
    # While the probe is in flight nothing else goes there, though it is the least loaded.
    others = [balancer.pick(MODEL) for _ in range(5)]
    assert [e.replica_id for e in others] == ["2"] * 5
    balancer.succeeded(probe)
    balancer.release(probe)
    assert ejected_ids(balancer) == []
    for endpoint in others:
        balancer.release(endpoint)
    assert picks(balancer) == ["1"] * 6


def test_a_probe_that_ends_without_an_outcome_lets_the_next_request_probe():
    clock = Clock()
    balancer = ejecting_balancer("http://a:1", "http://b:1", clock=clock)
    fail(balancer, "1")
    clock.now += 1.0
    probe = balancer.pick(MODEL)
    assert probe.replica_id == "1"
    balancer.release(probe)  # the client went away before the engine answered
    assert ejected_ids(balancer) == ["1"]
    assert balancer.pick(MODEL).replica_id == "1"


def test_answers_to_requests_sent_before_the_ejection_do_not_end_the_cool_down():
    clock = Clock()
    balancer = ejecting_balancer("http://a:1", "http://b:1", clock=clock)
    fail(balancer, "1")
    serve(balancer, "1")  # a slow request sent before the refusal answers now
    fail(balancer, "1", Failure.LOST)
    assert ejected_ids(balancer) == ["1"]
    clock.now += 0.5
    assert picks(balancer) == ["2"] * 6
    clock.now += 0.5  # still the first cool-down: neither answer moved it
    assert balancer.pick(MODEL).replica_id == "1"


def test_the_last_replica_not_ejected_is_never_ejected():
    clock = Clock()
    balancer = ejecting_balancer("http://a:1", "http://b:1", clock=clock)
    fail(balancer, "1")
    for _ in range(10):
        fail(balancer, "2", Failure.CONNECT)
    assert ejected_ids(balancer) == ["1"]
    assert picks(balancer) == ["2"] * 6


def test_the_only_replica_of_a_model_is_never_ejected():
    balancer = ejecting_balancer("http://a:1", clock=Clock())
    for failure in (Failure.CONNECT, Failure.LOST, Failure.ERROR) * 3:
        fail(balancer, "1", failure)
    assert ejected_ids(balancer) == []
    assert balancer.pick(MODEL).replica_id == "1"


def test_when_every_replica_left_is_ejected_the_one_ejected_longest_ago_is_picked():
    clock = Clock()
    balancer = ejecting_balancer("http://a:1", "http://b:1", "http://c:1", clock=clock)
    fail(balancer, "2")
    clock.now += 0.3
    fail(balancer, "1")
    balancer.apply_table(preferred_in_order("http://a:1", "http://b:1", fingerprint="without c"))
    assert ejected_ids(balancer) == ["1", "2"]
    assert picks(balancer, 3) == ["2"] * 3
    # A retry that excludes it still finds the other ejected one rather than nothing.
    second = next(e for e in balancer.endpoints(MODEL) if e.replica_id == "2")
    assert balancer.pick(MODEL, exclude=[second]).replica_id == "1"


def test_ejection_state_survives_a_table_update_for_replicas_that_stay_and_not_a_new_url():
    clock = Clock()
    balancer = ejecting_balancer("http://a:1", "http://b:1", "http://c:1", clock=clock)
    fail(balancer, "1")
    fail(balancer, "2", Failure.ERROR)
    fail(balancer, "2", Failure.ERROR)
    table = preferred_in_order("http://a:1", "http://b:1", "http://c:1", fingerprint="reweighted", weights=[2])
    assert balancer.apply_table(table)
    assert ejected_ids(balancer) == ["1"]
    assert "1" not in picks(balancer)
    fail(balancer, "2", Failure.ERROR)  # the third in a row, counted across the table change
    assert ejected_ids(balancer) == ["1", "2"]
    # A replica restarted elsewhere (new URL) is a new engine: it starts healthy.
    balancer.apply_table(preferred_in_order("http://a:2", "http://b:1", "http://c:1", fingerprint="moved"))
    assert ejected_ids(balancer) == ["2"]
    assert balancer.ejection_counts() == {MODEL: 2}


def test_ejection_metrics_count_ejections_and_the_replicas_ejected_now():
    clock = Clock()
    balancer = ejecting_balancer("http://a:1", "http://b:1", clock=clock)
    metrics = RouterMetrics(balancer)
    text = metrics.render().decode()
    assert f'llmgw_router_ejected_replicas{{model="{MODEL}"}} 0.0' in text
    fail(balancer, "1")
    clock.now += 1
    probe = balancer.pick(MODEL)
    balancer.release(probe, Failure.CONNECT)
    text = metrics.render().decode()
    assert f'llmgw_router_ejections_total{{model="{MODEL}"}} 2.0' in text
    assert f'llmgw_router_ejected_replicas{{model="{MODEL}"}} 1.0' in text
    clock.now += 2
    probe = balancer.pick(MODEL)
    balancer.succeeded(probe)
    balancer.release(probe)
    text = metrics.render().decode()
    assert f'llmgw_router_ejected_replicas{{model="{MODEL}"}} 0.0' in text
    assert f'llmgw_router_ejections_total{{model="{MODEL}"}} 2.0' in text


def test_an_ejection_policy_that_cannot_work_is_refused():
    with pytest.raises(ValueError):
        EjectionPolicy(connect_failures=0)
    with pytest.raises(ValueError):
        EjectionPolicy(first_cooldown=5, max_cooldown=1)
