"""Token counts in the hub, on both backends: routers' counts add up per hour, the tick takes them exactly once."""

import asyncio
import threading

import msgspec
import pytest
import redis

from hub import InProcessHub, RedisHub
from hub.contracts import TokenCounts, UsageReport, hour_of
from hub.redis_hub import TOKENS_KEY
from hub.tests.test_hubs import FakeClock

T0 = 1_800_000_000.0  # on an hour boundary
assert hour_of(T0) == T0


@pytest.fixture(params=["in-process", "redis"])
def clocked_hub(request):
    clock = FakeClock(T0 + 10)
    if request.param == "in-process":
        return InProcessHub(clock=clock), clock
    return RedisHub(request.getfixturevalue("redis_url"), clock=clock), clock


def report(router, tokens=None, keys=None):
    """A report of `tokens` given as {digest: {model: [requests, prompt, completion(, spend)]}}: a report
    without spend is an older router's."""
    return UsageReport(router=router, tokens=msgspec.convert(tokens or {}, TokenCounts), keys=keys or {})


def plain(tokens):
    """Taken token counts as {hour: {digest: {model: [requests, prompt, completion, spend]}}}, as compared."""
    return msgspec.to_builtins(tokens)


def test_two_routers_counts_add_up_and_one_take_gets_them_all_once(clocked_hub):
    hub, _ = clocked_hub
    asyncio.run(hub.report_usage(report("a", {"k1": {"llama": [2, 10, 20, 7 * 10**15]}}, {"k1": T0 + 5})))
    asyncio.run(
        hub.report_usage(report("b", {"k1": {"llama": [1, 1, 1], "qwen": [1, 2, 3]}, "k2": {"llama": [1, 0, 0]}}))
    )
    asyncio.run(hub.report_usage(report("a", {"k1": {"llama": [1, 1, 1, 3]}})))
    snapshot = hub.collect_usage()
    assert plain(snapshot.tokens) == {
        int(T0): {"k1": {"llama": [4, 12, 22, 7 * 10**15 + 3], "qwen": [1, 2, 3, 0]}, "k2": {"llama": [1, 0, 0, 0]}}
    }
    # Taken: a second collection (a second tick, or another leader) finds nothing to count again.
    again = hub.collect_usage()
    assert plain(again.tokens) == {} and again.keys == {}


def test_counts_are_kept_per_hour_of_the_report(clocked_hub):
    hub, clock = clocked_hub
    asyncio.run(hub.report_usage(report("a", {"k": {"m": [1, 1, 1]}})))
    clock.now = T0 + 3600 + 1
    asyncio.run(hub.report_usage(report("a", {"k": {"m": [1, 2, 2]}})))
    assert plain(hub.collect_usage().tokens) == {
        int(T0): {"k": {"m": [1, 1, 1, 0]}},
        int(T0) + 3600: {"k": {"m": [1, 2, 2, 0]}},
    }


def test_key_last_use_is_newest_wins_and_taken_with_the_tokens(clocked_hub):
    hub, _ = clocked_hub
    asyncio.run(hub.report_usage(report("a", keys={"k1": 200.0, "k2": 50.0})))
    asyncio.run(hub.report_usage(report("b", keys={"k1": 100.0, "k2": 60.0})))
    assert hub.collect_usage().keys == {"k1": 200.0, "k2": 60.0}
    assert hub.collect_usage().keys == {}


def test_restored_counts_add_to_what_arrived_meanwhile(clocked_hub):
    hub, _ = clocked_hub
    asyncio.run(hub.report_usage(report("a", {"k": {"m": [1, 1, 1]}}, {"k": 100.0})))
    taken = hub.collect_usage()
    asyncio.run(hub.report_usage(report("a", {"k": {"m": [1, 5, 5]}}, {"k": 90.0})))
    hub.restore_tokens(taken.tokens, taken.keys)
    snapshot = hub.collect_usage()
    assert plain(snapshot.tokens) == {int(T0): {"k": {"m": [2, 6, 6, 0]}}}
    assert snapshot.keys == {"k": 100.0}


def test_reports_racing_a_take_are_each_counted_exactly_once(clocked_hub):
    """Routers flushing while ticks take: the sum of what the ticks took is what the routers sent."""
    hub, _ = clocked_hub
    flushes, taken = 200, []
    done = threading.Event()

    def tick():
        while not done.is_set():
            taken.append(plain(hub.collect_usage().tokens))
        taken.append(plain(hub.collect_usage().tokens))

    ticker = threading.Thread(target=tick)
    ticker.start()

    async def routers():
        for _ in range(flushes):
            await hub.report_usage(report("a", {"k": {"m": [1, 2, 3, 4]}}))

    asyncio.run(routers())
    done.set()
    ticker.join(10)
    total = [0, 0, 0, 0]
    for tokens in taken:
        for counts in tokens.values():
            total = [t + n for t, n in zip(total, counts["k"]["m"], strict=True)]
    assert total == [flushes, 2 * flushes, 3 * flushes, 4 * flushes]


def nothing_stored(hub):
    snapshot = hub.collect_usage()
    return snapshot.stamps == {} and snapshot.routers == [] and snapshot.tokens == {} and snapshot.keys == {}


@pytest.mark.parametrize(
    "tokens",
    [{"k": {"m": [1, 2]}}, {"k": {"m": [1, -2, 3]}}, {"k": {"m": [1, 2, 3.5]}}, {"": {"m": [1, 1, 1]}}, {"k": []}],
)
def test_a_malformed_token_report_is_refused_naming_the_field_and_nothing_stored(clocked_hub, tokens):
    hub, _ = clocked_hub
    with pytest.raises(ValueError, match=r"`\$\.tokens"):
        asyncio.run(hub.report_usage(UsageReport(router="a", stamps={"1": 5.0}, tokens=tokens)))
    assert nothing_stored(hub)


def test_a_malformed_key_last_use_is_refused_naming_the_field_and_nothing_stored(clocked_hub):
    hub, _ = clocked_hub
    with pytest.raises(ValueError, match=r"at `\$\.keys"):
        asyncio.run(hub.report_usage(UsageReport(router="a", stamps={"1": 5.0}, keys={"k": float("nan")})))
    assert nothing_stored(hub)


def test_redis_drops_a_malformed_counter_and_takes_the_others(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.hset(TOKENS_KEY, "bogus", "1")
    hub = RedisHub(redis_url, clock=FakeClock(T0))
    asyncio.run(hub.report_usage(report("a", {"k": {"model with spaces": [1, 2, 3]}})))
    assert plain(hub.collect_usage().tokens) == {int(T0): {"k": {"model with spaces": [1, 2, 3, 0]}}}
    assert not client.exists(TOKENS_KEY)
    client.close()


def test_tokens_per_replica_add_up_and_are_taken_with_the_token_counts_and_restored(clocked_hub):
    """The showback's shares (keys.showback) travel beside the token counts: added up across routers per hour,
    taken in the same step, given back whole when the database refuses them."""
    hub, clock = clocked_hub
    asyncio.run(hub.report_usage(UsageReport(router="a", replica_tokens={"7": {"k1": 30, "k2": 5}})))
    asyncio.run(hub.report_usage(UsageReport(router="b", replica_tokens={"7": {"k1": 10}, "8": {"k1": 4}})))
    clock.now = T0 + 3600 + 1
    asyncio.run(hub.report_usage(UsageReport(router="a", replica_tokens={"7": {"k2": 1}})))
    taken = hub.collect_usage()
    shares = {int(T0): {"7": {"k1": 40, "k2": 5}, "8": {"k1": 4}}, int(T0) + 3600: {"7": {"k2": 1}}}
    assert taken.replica_tokens == shares
    assert hub.collect_usage().replica_tokens == {}
    hub.restore_tokens(taken.tokens, taken.keys, taken.replica_tokens)
    assert hub.collect_usage().replica_tokens == shares
