"""Replica choice, outlier ejection, name resolution and last-use stamps: the picker over its route table and ledger (no I/O)."""

import json

import pytest

from router.endpoints.table import TableError, decode_table
from router.metrics import RouterMetrics
from router.picking.ejection import EjectionPolicy, Failure
from router.tests.conftest import (
    ALIAS,
    MODEL,
    Clock,
    in_flight_by_model,
    make_table,
    new_picker,
    pending_stamps,
    table_of,
    table_rows,
)


def picker_with(*endpoints, clock=None):
    picker = new_picker(clock=clock) if clock else new_picker()
    picker.routes.apply_table(make_table(endpoints))
    return picker


def test_pick_prefers_the_highest_priority_even_when_it_is_busier():
    picker = picker_with({"url": "http://a:1", "priority": 0}, {"url": "http://b:1", "priority": 5})
    picks = [picker.pick(MODEL).url for _ in range(4)]
    assert picks == ["http://b:1"] * 4


def test_pick_spreads_by_outstanding_requests_per_weight():
    picker = picker_with({"url": "http://a:1", "weight": 1}, {"url": "http://b:1", "weight": 3})
    picks = [picker.pick(MODEL).url for _ in range(8)]
    # Weight 3 carries three times the outstanding requests of weight 1.
    assert picks.count("http://b:1") == 6
    assert picks.count("http://a:1") == 2


def test_released_replica_is_preferred_again():
    picker = picker_with("http://a:1", "http://b:1")
    first = picker.pick(MODEL)
    second = picker.pick(MODEL)
    assert {first.url, second.url} == {"http://a:1", "http://b:1"}
    picker.release(first)
    assert picker.pick(MODEL) is first


def test_ties_are_taken_in_turn():
    picker = picker_with("http://a:1", "http://b:1", "http://c:1")
    picks = []
    for _ in range(6):
        endpoint = picker.pick(MODEL)
        picks.append(endpoint.url)
        picker.release(endpoint)
    assert picks == ["http://a:1", "http://b:1", "http://c:1"] * 2


def test_pick_excludes_replicas_already_tried():
    picker = picker_with("http://a:1", "http://b:1")
    first, second = picker.routes.endpoints(MODEL)
    assert picker.pick(MODEL, exclude=[first]).replica_id == "2"
    assert picker.pick(MODEL, exclude=[first, second]) is None


def test_a_replica_placed_again_on_a_new_url_is_not_excluded_by_its_old_endpoint():
    """The control plane keeps a replica's id when it re-places it; the endpoint (URL) is new."""
    picker = picker_with("http://a:1")
    (old,) = picker.routes.endpoints(MODEL)
    picker.routes.apply_table(make_table(["http://a:2"], fingerprint="placed again"))
    (new,) = picker.routes.endpoints(MODEL)
    assert (new.replica_id, new.url) == (old.replica_id, "http://a:2")
    assert picker.pick(MODEL, exclude=[old]) is new


def test_pick_stamps_last_use_of_the_chosen_replica_only():
    now = [1000.0]
    picker = picker_with("http://a:1", "http://b:1", clock=lambda: now[0])
    chosen = picker.pick(MODEL)
    assert pending_stamps(picker) == {chosen.replica_id: 1000.0}
    now[0] = 1005.0
    picker.release(chosen)
    again = picker.pick(MODEL)
    assert picker.ledger.take_usage()[0] == {chosen.replica_id: 1000.0, again.replica_id: 1005.0}
    assert pending_stamps(picker) == {}


def test_a_replica_serving_a_long_request_is_stamped_at_every_flush_until_it_ends():
    now = [1000.0]
    picker = picker_with("http://a:1", clock=lambda: now[0])
    streaming = picker.pick(MODEL)
    assert picker.ledger.take_usage()[0] == {"1": 1000.0}
    now[0] = 1300.0
    assert picker.ledger.take_usage()[0] == {"1": 1300.0}
    picker.release(streaming)
    now[0] = 1600.0
    assert picker.ledger.take_usage()[0] == {}


OTHER = "qwen"


def two_model_picker():
    picker = new_picker()
    table = table_rows(["http://a:1", "http://b:1"], models={MODEL: {"aliases": []}, OTHER: {"aliases": []}})
    table["endpoints"].append({"replica_id": "3", "model": OTHER, "url": "http://c:1"})
    picker.routes.apply_table(table_of(table))
    return picker


def test_in_flight_peaks_are_counted_per_model_and_taken_with_the_stamps():
    picker = two_model_picker()
    first, second, third = (picker.pick(MODEL) for _ in range(3))
    other = picker.pick(OTHER)
    picker.release(first)
    assert in_flight_by_model(picker) == {MODEL: 2, OTHER: 1}
    stamps, peaks = picker.ledger.take_usage()
    assert peaks == {MODEL: 3, OTHER: 1}
    assert set(stamps) == {"1", "2", "3"}
    for endpoint in (second, third, other):
        picker.release(endpoint)
    assert in_flight_by_model(picker) == {}


def test_a_peak_between_two_takes_survives_even_when_its_requests_ended_before_the_take():
    picker = two_model_picker()
    quick = [picker.pick(MODEL) for _ in range(4)]
    for endpoint in quick:
        picker.release(endpoint, Failure.CONNECT if endpoint is quick[0] else None)
    assert picker.ledger.take_usage()[1] == {MODEL: 4}
    assert picker.ledger.take_usage()[1] == {}  # nothing in flight: the next window starts empty


def test_the_next_peak_window_starts_at_what_is_in_flight_at_the_take():
    picker = two_model_picker()
    long_running = [picker.pick(MODEL) for _ in range(2)]
    picker.release(picker.pick(MODEL))
    assert picker.ledger.take_usage()[1] == {MODEL: 3}
    # Two requests still streaming: they count in the next window even if nothing new arrives.
    assert picker.ledger.take_usage()[1] == {MODEL: 2}
    picker.release(long_running[0])
    extra = picker.pick(OTHER)
    assert picker.ledger.take_usage()[1] == {MODEL: 2, OTHER: 1}
    assert picker.ledger.take_usage()[1] == {MODEL: 1, OTHER: 1}
    picker.release(long_running[1])
    picker.release(extra)
    assert picker.ledger.take_usage()[1] == {MODEL: 1, OTHER: 1}
    assert picker.ledger.take_usage()[1] == {}


def test_in_flight_follows_the_model_of_the_replica_across_table_updates():
    picker = two_model_picker()
    busy = picker.pick(MODEL)
    picker.routes.apply_table(make_table([], models={MODEL: {"aliases": []}}, fingerprint="all gone"))
    assert in_flight_by_model(picker) == {MODEL: 1}
    picker.release(busy)  # its replica left the table while the request ran
    assert in_flight_by_model(picker) == {}


def test_restored_stamps_do_not_overwrite_newer_ones():
    picker = new_picker()
    picker.ledger.restore_stamps({"1": 10.0, "2": 30.0})
    picker.ledger.restore_stamps({"1": 20.0, "2": 5.0})
    assert pending_stamps(picker) == {"1": 20.0, "2": 30.0}


def test_outstanding_requests_survive_a_table_update_for_the_same_replica():
    picker = picker_with("http://a:1", "http://b:1")
    busy = picker.pick(MODEL)
    table = make_table([{"url": "http://a:1", "pool": "batch"}, "http://b:1"], fingerprint="changed")
    assert picker.routes.apply_table(table)
    assert picker.ledger.in_flight() == 1
    # The idle one is chosen next, because the busy one still counts its request.
    assert picker.pick(MODEL) is not busy


def test_same_fingerprint_is_not_applied_twice():
    picker = new_picker()
    table = make_table(["http://a:1"], fingerprint="f1")
    assert picker.routes.apply_table(table)
    assert not picker.routes.apply_table(table)


def test_alias_resolves_to_the_public_name_and_unknown_names_do_not():
    picker = picker_with("http://a:1")
    assert picker.routes.resolve(ALIAS) == MODEL
    assert picker.routes.resolve(MODEL) == MODEL
    assert picker.routes.resolve("gpt-4") is None


def test_a_public_name_wins_over_an_alias_that_clashes_with_it():
    picker = new_picker()
    picker.routes.apply_table(table_of({"models": {"a": {"aliases": ["b"]}, "b": {"aliases": []}}, "endpoints": []}))
    assert picker.routes.resolve("b") == "b"


def test_malformed_endpoint_rows_are_skipped_and_the_rest_kept():
    picker = new_picker()
    table = table_rows(["http://a:1"])
    table["endpoints"] += [
        {"replica_id": "9", "model": MODEL},
        {"replica_id": "8", "model": MODEL, "url": "x"},
        {"replica_id": "7", "model": MODEL, "url": "http://c:1", "weight": 0},
    ]
    picker.routes.apply_table(decode_table(json.dumps(table).encode()))
    assert [e.replica_id for e in picker.routes.endpoints(MODEL)] == ["1"]


def test_endpoints_of_models_not_in_the_catalog_are_ignored():
    picker = new_picker()
    picker.routes.apply_table(make_table([{"url": "http://a:1", "model": "disabled"}]))
    assert picker.routes.endpoints() == []


def test_a_table_that_is_not_an_object_is_refused_by_name():
    with pytest.raises(TableError, match="not an object"):
        decode_table(b'["endpoints"]')


# -- outlier ejection ------------------------------------------------------------------------------


def ejecting_picker(*urls, clock, **policy):
    """Replicas "1", "2" … in order of preference (descending priority), so each pick is predictable."""
    picker = new_picker(ejection_clock=clock, ejection=EjectionPolicy(**policy))
    picker.routes.apply_table(preferred_in_order(*urls))
    return picker


def preferred_in_order(*urls, fingerprint="", weights=()):
    rows = [{"url": url, "priority": len(urls) - i} for i, url in enumerate(urls)]
    for row, weight in zip(rows, weights, strict=False):
        row["weight"] = weight
    return make_table(rows, fingerprint=fingerprint)


def fail(picker, replica_id, failure=Failure.CONNECT):
    """One request to `replica_id` that fails before its response (as the proxy reports it)."""
    endpoint = next(e for e in picker.routes.endpoints() if e.replica_id == replica_id)
    endpoint.outstanding += 1  # as a pick would have counted it
    picker.release(endpoint, failure)


def serve(picker, replica_id):
    """One request to `replica_id` that gets an answer below 500."""
    endpoint = next(e for e in picker.routes.endpoints() if e.replica_id == replica_id)
    endpoint.outstanding += 1
    picker.succeeded(endpoint)
    picker.release(endpoint)


def picks(picker, count=6):
    """The replica ids of `count` picks, each released at once."""
    chosen = []
    for _ in range(count):
        endpoint = picker.pick(MODEL)
        chosen.append(endpoint.replica_id)
        picker.release(endpoint)
    return chosen


def ejected_ids(picker):
    return sorted(e.replica_id for e in picker.ejected())


def test_a_replica_refusing_a_connection_is_ejected_at_the_first_failure():
    clock = Clock()
    picker = ejecting_picker("http://a:1", "http://b:1", clock=clock)
    fail(picker, "1", Failure.CONNECT)
    assert ejected_ids(picker) == ["1"]
    assert picks(picker) == ["2"] * 6
    assert picker.ejection_counts() == {MODEL: 1}


@pytest.mark.parametrize("failure", [Failure.ERROR, Failure.LOST])
def test_three_consecutive_5xx_or_lost_connections_eject_and_a_success_between_them_resets_the_count(failure):
    clock = Clock()
    picker = ejecting_picker("http://a:1", "http://b:1", clock=clock)
    fail(picker, "1", failure)
    fail(picker, "1", failure)
    serve(picker, "1")
    fail(picker, "1", failure)
    fail(picker, "1", failure)
    assert ejected_ids(picker) == []
    assert picks(picker) == ["1"] * 6
    fail(picker, "1", failure)
    assert ejected_ids(picker) == ["1"]
    assert picks(picker) == ["2"] * 6


def test_a_refused_connection_after_two_5xx_ejects():
    picker = ejecting_picker("http://a:1", "http://b:1", clock=Clock())
    fail(picker, "1", Failure.ERROR)
    fail(picker, "1", Failure.ERROR)
    fail(picker, "1", Failure.CONNECT)
    assert ejected_ids(picker) == ["1"]


def test_the_cool_down_doubles_with_each_failed_probe_up_to_the_cap_and_resets_after_a_success():
    clock = Clock()
    picker = ejecting_picker("http://a:1", "http://b:1", clock=clock)
    fail(picker, "1")
    for cooldown in (1, 2, 4, 8, 16, 30, 30, 30):
        ejected_at = clock.now
        clock.now = ejected_at + cooldown - 0.001
        assert picks(picker, 3) == ["2"] * 3
        clock.now = ejected_at + cooldown
        probe = picker.pick(MODEL)  # half-open: the preferred replica gets its probe
        assert probe.replica_id == "1"
        picker.release(probe, Failure.CONNECT)  # the probe fails: out again, for longer

    clock.now += 30
    probe = picker.pick(MODEL)
    assert probe.replica_id == "1"
    picker.succeeded(probe)
    picker.release(probe)
    assert ejected_ids(picker) == []
    # A success resets the streak: the next ejection is the first one again.
    fail(picker, "1")
    clock.now += 0.999
    assert picks(picker, 4) == ["2"] * 4
    clock.now += 0.002
    assert picker.pick(MODEL).replica_id == "1"


def test_a_half_open_replica_gets_exactly_one_probe_and_is_back_when_it_succeeds():
    clock = Clock()
    picker = ejecting_picker("http://a:1", "http://b:1", clock=clock)
    fail(picker, "1")
    clock.now += 1.0
    probe = picker.pick(MODEL)
    assert probe.replica_id == "1"
    # While the probe is in flight nothing else goes there, though it is the least loaded.
    others = [picker.pick(MODEL) for _ in range(5)]
    assert [e.replica_id for e in others] == ["2"] * 5
    picker.succeeded(probe)
    picker.release(probe)
    assert ejected_ids(picker) == []
    for endpoint in others:
        picker.release(endpoint)
    assert picks(picker) == ["1"] * 6


def test_a_probe_that_ends_without_an_outcome_lets_the_next_request_probe():
    clock = Clock()
    picker = ejecting_picker("http://a:1", "http://b:1", clock=clock)
    fail(picker, "1")
    clock.now += 1.0
    probe = picker.pick(MODEL)
    assert probe.replica_id == "1"
    picker.release(probe)  # the client went away before the engine answered
    assert ejected_ids(picker) == ["1"]
    assert picker.pick(MODEL).replica_id == "1"


def test_answers_to_requests_sent_before_the_ejection_do_not_end_the_cool_down():
    clock = Clock()
    picker = ejecting_picker("http://a:1", "http://b:1", clock=clock)
    fail(picker, "1")
    serve(picker, "1")  # a slow request sent before the refusal answers now
    fail(picker, "1", Failure.LOST)
    assert ejected_ids(picker) == ["1"]
    clock.now += 0.5
    assert picks(picker) == ["2"] * 6
    clock.now += 0.5  # still the first cool-down: neither answer moved it
    assert picker.pick(MODEL).replica_id == "1"


def test_the_last_replica_not_ejected_is_never_ejected():
    clock = Clock()
    picker = ejecting_picker("http://a:1", "http://b:1", clock=clock)
    fail(picker, "1")
    for _ in range(10):
        fail(picker, "2", Failure.CONNECT)
    assert ejected_ids(picker) == ["1"]
    assert picks(picker) == ["2"] * 6


def test_the_only_replica_of_a_model_is_never_ejected():
    picker = ejecting_picker("http://a:1", clock=Clock())
    for failure in (Failure.CONNECT, Failure.LOST, Failure.ERROR) * 3:
        fail(picker, "1", failure)
    assert ejected_ids(picker) == []
    assert picker.pick(MODEL).replica_id == "1"


def test_when_every_replica_left_is_ejected_the_one_ejected_longest_ago_is_picked():
    clock = Clock()
    picker = ejecting_picker("http://a:1", "http://b:1", "http://c:1", clock=clock)
    fail(picker, "2")
    clock.now += 0.3
    fail(picker, "1")
    picker.routes.apply_table(preferred_in_order("http://a:1", "http://b:1", fingerprint="without c"))
    assert ejected_ids(picker) == ["1", "2"]
    assert picks(picker, 3) == ["2"] * 3
    # A retry that excludes it still finds the other ejected one rather than nothing.
    second = next(e for e in picker.routes.endpoints(MODEL) if e.replica_id == "2")
    assert picker.pick(MODEL, exclude=[second]).replica_id == "1"


def test_ejection_state_survives_a_table_update_for_replicas_that_stay_and_not_a_new_url():
    clock = Clock()
    picker = ejecting_picker("http://a:1", "http://b:1", "http://c:1", clock=clock)
    fail(picker, "1")
    fail(picker, "2", Failure.ERROR)
    fail(picker, "2", Failure.ERROR)
    table = preferred_in_order("http://a:1", "http://b:1", "http://c:1", fingerprint="reweighted", weights=[2])
    assert picker.routes.apply_table(table)
    assert ejected_ids(picker) == ["1"]
    assert "1" not in picks(picker)
    fail(picker, "2", Failure.ERROR)  # the third in a row, counted across the table change
    assert ejected_ids(picker) == ["1", "2"]
    # A replica restarted elsewhere (new URL) is a new engine: it starts healthy.
    picker.routes.apply_table(preferred_in_order("http://a:2", "http://b:1", "http://c:1", fingerprint="moved"))
    assert ejected_ids(picker) == ["2"]
    assert picker.ejection_counts() == {MODEL: 2}


def test_ejection_metrics_count_ejections_and_the_replicas_ejected_now():
    clock = Clock()
    picker = ejecting_picker("http://a:1", "http://b:1", clock=clock)
    metrics = RouterMetrics(picker.routes, picker)
    text = metrics.render().decode()
    assert f'llmgw_router_ejected_replicas{{model="{MODEL}"}} 0.0' in text
    fail(picker, "1")
    clock.now += 1
    probe = picker.pick(MODEL)
    picker.release(probe, Failure.CONNECT)
    text = metrics.render().decode()
    assert f'llmgw_router_ejections_total{{model="{MODEL}"}} 2.0' in text
    assert f'llmgw_router_ejected_replicas{{model="{MODEL}"}} 1.0' in text
    clock.now += 2
    probe = picker.pick(MODEL)
    picker.succeeded(probe)
    picker.release(probe)
    text = metrics.render().decode()
    assert f'llmgw_router_ejected_replicas{{model="{MODEL}"}} 0.0' in text
    assert f'llmgw_router_ejections_total{{model="{MODEL}"}} 2.0' in text


def test_an_ejection_policy_that_cannot_work_is_refused():
    with pytest.raises(ValueError):
        EjectionPolicy(connect_failures=0)
    with pytest.raises(ValueError):
        EjectionPolicy(first_cooldown=5, max_cooldown=1)
