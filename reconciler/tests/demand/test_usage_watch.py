"""Unknown stays unknown at fleet level (DESIGN invariant 3): every router's mark, judged each tick."""

import asyncio
import time
from datetime import UTC, datetime

import msgspec
import pytest

from conftest import free_port
from hub import RedisHub
from hub.contracts import EndpointTable, RouterMark, UsageSnapshot
from reconciler.choices import ReplicaState
from reconciler.demand.usage import FLEET, assess_usage
from reconciler.models import Replica, UsageWatch
from router.accounting.flusher import UsageFlusher
from router.metrics import RouterMetrics
from router.tests.conftest import new_picker
from tests.fleet import make_model, ready_replicas

pytestmark = pytest.mark.django_db

NOW = 1_900_000_000.0


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def mark(router, *, since=NOW - 100, renewed=NOW - 1, ttl=3.0, in_flight=None):
    return RouterMark(router=router, since=since, renewed=renewed, ttl=ttl, in_flight=in_flight or {})


def snapshot(*marks):
    return UsageSnapshot(stamps={}, routers=list(marks))


def known_after_grace(*marks, when=NOW):
    """Assess twice: usage becomes complete at `when - 3`, known at `when` (ttl 3 s)."""
    assess_usage(snapshot(*marks), "", at(when - 3))
    return assess_usage(snapshot(*marks), "", at(when))


def test_a_failed_collection_makes_usage_unknown_and_says_why():
    known_after_grace(mark("a"))
    verdict = assess_usage(None, "Connection refused", at(NOW + 1))
    assert (verdict.known, verdict.reason) == (False, "could not collect usage: Connection refused")
    assert verdict.watching_since is None
    assert UsageWatch.objects.get(name=FLEET).reason == verdict.reason


def test_one_lapsed_router_makes_usage_unknown_though_others_keep_renewing():
    verdict = assess_usage(snapshot(mark("a"), mark("b", renewed=NOW - 42)), "", at(NOW))
    assert (verdict.known, verdict.reason) == (False, "router b has not reported usage for 42 s")
    several = assess_usage(snapshot(mark("a", renewed=NOW - 10), mark("b", renewed=NOW - 42)), "", at(NOW))
    assert several.reason == "router b has not reported usage for 42 s (and 1 more)"


def test_no_router_reporting_means_unknown():
    verdict = assess_usage(snapshot(), "", at(NOW))
    assert (verdict.known, verdict.reason) == (False, "no router is reporting usage")


def test_a_router_silent_past_the_forget_window_is_gone_and_ignored(settings):
    settings.LLMGW_ROUTER_FORGET_SECONDS = 300

    def marks(now):
        return mark("a", renewed=now - 1, in_flight={"llama": 1}), mark("dead", renewed=NOW - 301, in_flight={"x": 9})

    assess_usage(snapshot(*marks(NOW)), "", at(NOW))
    verdict = assess_usage(snapshot(*marks(NOW + 3)), "", at(NOW + 3))
    assert (verdict.known, verdict.gone, verdict.in_flight) == (True, ["dead"], {"llama": 1})
    alone = assess_usage(snapshot(marks(NOW)[1]), "", at(NOW))
    assert (alone.known, alone.reason, alone.gone) == (False, "no router is reporting usage", ["dead"])


def renewed_at(now):
    """Two routers that flushed a second before `now`, with mark lifetimes of 3 and 5 s."""
    return snapshot(mark("a", renewed=now - 1, ttl=3.0), mark("b", renewed=now - 1, ttl=5.0))


def test_complete_usage_is_known_only_after_the_longest_mark_lifetime_without_a_break():
    first = assess_usage(renewed_at(NOW), "", at(NOW))
    assert (first.known, first.reason) == (
        False,
        "waiting 5 s after usage became complete for routers to flush what they held",
    )
    assert assess_usage(renewed_at(NOW + 4.9), "", at(NOW + 4.9)).known is False
    assert assess_usage(renewed_at(NOW + 5), "", at(NOW + 5)).known is True
    assert UsageWatch.objects.get(name=FLEET).known_since == at(NOW)
    # A break (one tick without usage) starts the wait again.
    assert assess_usage(None, "down", at(NOW + 6)).known is False
    assert UsageWatch.objects.get(name=FLEET).known_since is None
    assert assess_usage(renewed_at(NOW + 7), "", at(NOW + 7)).known is False
    assert assess_usage(renewed_at(NOW + 12), "", at(NOW + 12)).known is True


def test_watching_since_is_the_later_of_complete_since_and_the_newest_router_watch():
    verdict = known_after_grace(mark("a", since=NOW - 100), mark("b", since=NOW - 50))
    assert verdict.watching_since == NOW - 3  # complete since then; both routers watched longer
    restarted = assess_usage(snapshot(mark("a"), mark("b", since=NOW + 0.5, renewed=NOW + 0.5)), "", at(NOW + 1))
    assert restarted.watching_since == NOW + 0.5  # b's new watch began after a gap of its own


def test_in_flight_peaks_are_summed_over_live_routers_only():
    verdict = assess_usage(
        snapshot(
            mark("a", in_flight={"llama": 3, "qwen": 1}),
            mark("b", in_flight={"llama": 2}),
            mark("lapsed", renewed=NOW - 10, in_flight={"llama": 50}),
        ),
        "",
        at(NOW),
    )
    assert verdict.in_flight == {"llama": 5, "qwen": 1}


def test_assessing_reads_one_row_and_writes_at_most_one(django_assert_num_queries):
    def fleet_at(now):
        return snapshot(*(mark(f"r{i}", renewed=now - 1) for i in range(50)))

    with django_assert_num_queries(2):  # read, create
        assess_usage(fleet_at(NOW), "", at(NOW))
    with django_assert_num_queries(1):  # read; nothing changed
        assess_usage(fleet_at(NOW + 1), "", at(NOW + 1))
    with django_assert_num_queries(2):  # read, update: known now, the waiting reason is cleared
        assert assess_usage(fleet_at(NOW + 3), "", at(NOW + 3)).known is True
    with django_assert_num_queries(1):  # read; still known since the same moment
        assert assess_usage(fleet_at(NOW + 4), "", at(NOW + 4)).known is True
    with django_assert_num_queries(2):  # read, update
        assess_usage(None, "down", at(NOW + 5))


# -- routers flushing through real Redis ------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def router_on(hub, router_id, replicas, model):
    picker = new_picker(clock=hub._clock)
    table = {
        "models": {model.name: {"aliases": []}},
        "endpoints": [{"replica_id": str(r.pk), "model": model.name, "url": "http://127.0.0.1:1"} for r in replicas],
    }
    picker.routes.apply_table(msgspec.convert(table, EndpointTable))
    return UsageFlusher(hub, picker.ledger, RouterMetrics(), flush_seconds=1.0, router_id=router_id), picker


def flush(*flushers):
    return [asyncio.run(flusher.flush()) for flusher in flushers]


def use(picker, model):
    picker.release(picker.pick(model.name))


@pytest.fixture
def redis_fleet(redis_url):
    """A model with two ready replicas, a clock, and hubs on the real Redis and on a dead port."""
    clock = FakeClock()
    model = make_model("llama", min_replicas=0, max_replicas=2, idle_timeout_seconds=60)
    replicas = ready_replicas(model, [None, None])
    live = RedisHub(redis_url, clock=clock)
    dead = RedisHub(f"redis://127.0.0.1:{free_port()}/0", clock=clock)
    return clock, model, replicas, live, dead


def test_two_routers_one_unable_to_flush_make_idleness_unknown(run_tick, redis_fleet):
    clock, model, replicas, live, dead = redis_fleet
    (working, _), (failing, failing_picker) = (
        router_on(live, "router-a", replicas, model),
        router_on(live, "router-b", replicas, model),
    )
    assert flush(working, failing) == [True, True]
    run_tick(now=at(clock.now), hub=live)
    clock.now += 3
    flush(working, failing)
    assert run_tick(now=at(clock.now), hub=live).usage_known is True

    failing.hub = dead  # router-b loses Redis; router-a keeps renewing its own mark
    use(failing_picker, model)
    for _ in range(5):
        clock.now += 1
        assert flush(working, failing) == [True, False]
    report = run_tick(now=at(clock.now), hub=live)
    assert report.usage_known is False
    assert report.usage_unknown_reason == "router router-b has not reported usage for 5 s"
    assert report.usage_idle_since_ready == 0
    assert failing.ledger.waiting_stamps()  # what it used waits in its memory, not lost

    failing.hub = live  # back: its held stamps land, then the fleet is known again after a mark lifetime
    clock.now += 1
    flush(working, failing)
    back = run_tick(now=at(clock.now), hub=live)
    assert (back.usage_known, back.usage_updated) == (False, 1)
    clock.now += 3
    flush(working, failing)
    assert run_tick(now=at(clock.now), hub=live).usage_known is True


@pytest.mark.parametrize("outage", [120, 400], ids=["longer-than-idle-timeout", "longer-than-forget-window"])
def test_a_redis_outage_leaves_idleness_unknown_during_it_and_for_the_grace_after(
    run_tick, redis_fleet, settings, outage
):
    """Replicas in use all through an outage longer than their idle timeout (60 s) are never stopped:
    the stamps the tick last saw go stale, but idleness is unknown until the routers' memory has landed."""
    settings.LLMGW_ROUTER_FORGET_SECONDS = 300
    clock, model, replicas, live, dead = redis_fleet
    (first, _), (second, second_picker) = (
        router_on(live, "router-a", replicas, model),
        router_on(live, "router-b", replicas, model),
    )
    use(second_picker, model)
    use(second_picker, model)  # both replicas have a known last use before the outage
    flush(first, second)
    run_tick(now=at(clock.now), hub=live)
    clock.now += 3
    flush(first, second)
    known = run_tick(now=at(clock.now), hub=live)
    assert known.usage_known is True
    assert known.replicas_idle_stopped == 0
    assert Replica.objects.filter(state=ReplicaState.READY).count() == 2  # nothing was stopped
    assert Replica.objects.filter(last_used__isnull=False).count() == 2

    first.hub = second.hub = dead
    for _ in range(outage // 20):
        clock.now += 20
        use(second_picker, model)  # used during the outage: only router-b's memory knows
        flush(first, second)
        during = run_tick(now=at(clock.now), hub=dead)
        assert during.usage_known is False
        assert during.usage_unknown_reason.startswith("could not collect usage: ")
        assert during.replicas_idle_stopped == 0

    # Redis is back; router-a flushes first, router-b's flush comes a second later.
    first.hub = second.hub = live
    clock.now += 20
    flush(first)
    after = run_tick(now=at(clock.now), hub=live)
    assert after.usage_known is False
    if outage > 300:  # router-b's old mark is past the forget window: dropped, and the grace covers its return
        assert after.usage_unknown_reason.startswith("waiting 3 s")
        assert [m.router for m in live.collect_usage().routers] == ["router-a"]
    else:
        assert after.usage_unknown_reason.startswith("router router-b has not reported usage for")
    clock.now += 1
    flush(first, second)
    landed = run_tick(now=at(clock.now), hub=live)
    # router-b's stamps from the outage (both replicas) arrived before idleness became known.
    assert (landed.usage_known, landed.usage_updated) == (False, 2)
    clock.now += 3
    flush(first, second)
    known = run_tick(now=at(clock.now), hub=live)
    assert known.usage_known is True
    assert known.replicas_idle_stopped == 0
    assert Replica.objects.filter(state=ReplicaState.READY).count() == 2  # nothing was stopped
