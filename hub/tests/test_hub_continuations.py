"""Continuation counts in the hub, on both backends: routers' counts of broken answers add up per hour and model,
the tick (or router-only mode's store) takes them exactly once, and what could not be stored is given back."""

import asyncio
import threading

import msgspec
import pytest
import redis

from hub import InProcessHub, RedisHub
from hub.contracts import ContinuationCounts, UsageReport, checked
from hub.redis_hub import CONTINUATIONS_KEY
from hub.tests.test_hub_tokens import T0
from hub.tests.test_hubs import FakeClock

H0 = int(T0)


@pytest.fixture(params=["in-process", "redis"])
def clocked_hub(request):
    clock = FakeClock(T0 + 10)
    if request.param == "in-process":
        return InProcessHub(clock=clock), clock
    return RedisHub(request.getfixturevalue("redis_url"), clock=clock), clock


def report(router, continuations):
    """A report of `continuations` given as {model: [continued, failed, refused, reprocessed]}."""
    return UsageReport(router=router, continuations=msgspec.convert(continuations, ContinuationCounts))


def plain(continuations):
    """Taken counts as {hour: {model: [continued, failed, refused, reprocessed]}}, as they are compared."""
    return msgspec.to_builtins(continuations)


def test_a_report_without_continuations_is_valid_and_counts_none():
    """A router older than the field sends no `continuations`: its report decodes, with none counted."""
    old = msgspec.json.decode(b'{"router": "a", "stamps": {"1": 5.0}}', type=UsageReport)
    assert checked(old).continuations == {}


@pytest.mark.parametrize(
    "continuations",
    [{"m": [1, 2, 3]}, {"m": [1, -1, 0, 0]}, {"m": [1, 0, 0, 0.5]}, {"": [1, 0, 0, 0]}, {"m": {"continued": 1}}],
)
def test_a_malformed_continuation_report_is_refused_naming_the_field_and_nothing_stored(clocked_hub, continuations):
    hub, _ = clocked_hub
    with pytest.raises(ValueError, match=r"`\$\.continuations"):
        asyncio.run(hub.report_usage(UsageReport(router="a", stamps={"1": 5.0}, continuations=continuations)))
    snapshot = hub.collect_usage()
    assert snapshot.continuations == {} and snapshot.stamps == {} and snapshot.routers == []


def test_two_routers_counts_add_up_per_model_and_one_take_gets_them_all_once(clocked_hub):
    hub, _ = clocked_hub
    asyncio.run(hub.report_usage(report("a", {"llama": [2, 1, 0, 300]})))
    asyncio.run(hub.report_usage(report("b", {"llama": [1, 0, 1, 50], "qwen": [0, 0, 2, 0]})))
    assert plain(hub.collect_usage().continuations) == {H0: {"llama": [3, 1, 1, 350], "qwen": [0, 0, 2, 0]}}
    # Taken: a second collection (a second tick, or another leader) finds nothing to count again.
    assert hub.collect_usage().continuations == {}


def test_counts_are_kept_per_hour_of_the_report(clocked_hub):
    hub, clock = clocked_hub
    asyncio.run(hub.report_usage(report("a", {"m": [1, 0, 0, 10]})))
    clock.now = T0 + 3600 + 1
    asyncio.run(hub.report_usage(report("a", {"m": [0, 1, 0, 0]})))
    assert plain(hub.collect_usage().continuations) == {H0: {"m": [1, 0, 0, 10]}, H0 + 3600: {"m": [0, 1, 0, 0]}}


def test_restored_counts_add_to_what_arrived_meanwhile(clocked_hub):
    hub, _ = clocked_hub
    asyncio.run(hub.report_usage(report("a", {"m": [1, 0, 0, 10]})))
    taken = hub.collect_usage().continuations
    asyncio.run(hub.report_usage(report("a", {"m": [0, 1, 1, 0]})))
    hub.restore_continuations(taken)
    assert plain(hub.collect_usage().continuations) == {H0: {"m": [1, 1, 1, 10]}}


def test_router_only_mode_takes_them_apart_from_the_tick(clocked_hub):
    """`take_continuations` (router-only mode's store) takes what `collect_usage` would have: once."""
    hub, _ = clocked_hub
    asyncio.run(hub.report_usage(report("a", {"m": [1, 0, 0, 10]})))
    taken = hub.take_continuations()
    assert plain(taken) == {H0: {"m": [1, 0, 0, 10]}}
    assert hub.take_continuations() == {} and hub.collect_usage().continuations == {}
    hub.restore_continuations(taken)
    assert plain(hub.take_continuations()) == {H0: {"m": [1, 0, 0, 10]}}


def test_reports_racing_a_take_are_each_counted_exactly_once(clocked_hub):
    """Routers flushing while ticks take: the sum of what the ticks took is what the routers sent."""
    hub, _ = clocked_hub
    flushes, taken = 200, []
    done = threading.Event()

    def tick():
        while not done.is_set():
            taken.append(plain(hub.collect_usage().continuations))
        taken.append(plain(hub.collect_usage().continuations))

    ticker = threading.Thread(target=tick)
    ticker.start()

    async def routers():
        for _ in range(flushes):
            await hub.report_usage(report("a", {"m": [1, 2, 3, 4]}))

    asyncio.run(routers())
    done.set()
    ticker.join(10)
    total = [0, 0, 0, 0]
    for counts in (hour["m"] for hours in taken for hour in hours.values()):
        total = [t + n for t, n in zip(total, counts, strict=True)]
    assert total == [flushes, 2 * flushes, 3 * flushes, 4 * flushes]


def test_redis_keeps_zeros_out_and_drops_a_malformed_counter(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.hset(CONTINUATIONS_KEY, "bogus", "1")
    client.hset(CONTINUATIONS_KEY, f"failed {H0} m", "x")
    hub = RedisHub(redis_url, clock=FakeClock(T0))
    asyncio.run(hub.report_usage(report("a", {"model with spaces": [1, 0, 0, 0]})))
    assert client.hlen(CONTINUATIONS_KEY) == 3  # the report's zeros cost no field
    assert plain(hub.collect_usage().continuations) == {H0: {"model with spaces": [1, 0, 0, 0]}}
    assert not client.exists(CONTINUATIONS_KEY)
    client.close()
