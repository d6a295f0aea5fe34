"""Last-use stamps (DESIGN invariant 4): flushed once per interval, never per request, never failing a request."""

import asyncio
import os
import time

import httpx
import msgspec
import pytest
import redis

from conftest import free_port, wait_until
from hub import InProcessHub, RedisHub, get_hub
from hub.contracts import UsageReport
from hub.redis_hub import USAGE_KEY
from router.accounting.flusher import UsageFlusher, new_router_id
from router.metrics import RouterMetrics
from router.tests.conftest import MODEL, make_table, new_picker, pending_stamps
from router.tests.forwarding.test_proxy import CountingHub, chat, run_concurrently

pytestmark = pytest.mark.django_db(transaction=True)


def test_stamps_reach_the_hub_within_a_second_in_one_flush_for_many_requests(start_router, hub, auth, start_engine):
    counting = CountingHub(hub)
    engine = start_engine()
    hub.publish_endpoints(make_table([engine.url]))
    router = start_router(counting, flush_seconds=0.5)
    before = time.time()
    results = run_concurrently(router, auth, 20)
    after = time.time()
    assert [status for status, _ in results] == [200] * 20
    stamps = wait_until(lambda: hub.collect_usage().stamps, timeout=1.0)
    assert list(stamps) == ["1"]
    assert before <= stamps["1"] <= after
    # Twenty requests, one or two flushes (the batch may straddle a flush): cost follows time, not traffic.
    assert 1 <= len(counting.usage_flushes) <= 2


def test_no_flush_is_made_while_nothing_was_used(start_router, hub, start_engine):
    counting = CountingHub(hub)
    hub.publish_endpoints(make_table([start_engine().url]))
    router = start_router(counting, flush_seconds=0.05)
    # Every flush renews the watch mark, used or not: wait for flushes, not for time.
    wait_until(lambda: counting.watch_renewals >= 3)
    assert {report.router for report in counting.reports} == {router.state.usage.router_id}
    assert httpx.get(f"{router.url}/health").status_code == 200
    renewed = counting.watch_renewals
    wait_until(lambda: counting.watch_renewals >= renewed + 3)
    assert counting.usage_flushes == []


class UnreachableRedisHub(RedisHub):
    """A RedisHub whose Redis is a closed port; the endpoint table is handed over in memory instead."""

    def __init__(self, table):
        super().__init__(f"redis://127.0.0.1:{free_port()}/0")
        self.table = msgspec.json.encode(table)

    async def read_endpoints(self):
        return self.table

    async def watch_endpoints(self):
        # Nothing is ever pushed; the startup read is enough.
        if False:
            yield


def test_unreachable_redis_does_not_fail_requests_and_stamps_wait_for_the_next_flush(start_router, auth, start_engine):
    engine = start_engine()
    hub = UnreachableRedisHub(make_table([engine.url], fingerprint="f"))
    router = start_router(hub, flush_seconds=0.05)
    for _ in range(3):
        assert chat(router, auth).status_code == 200
    registry = router.state.metrics.registry
    wait_until(lambda: (registry.get_sample_value("llmgw_router_usage_flush_failures_total") or 0) >= 2)
    assert list(pending_stamps(router.state.picker)) == ["1"]
    assert chat(router, auth).status_code == 200


def test_router_starts_and_answers_when_the_store_is_unreachable(start_router, auth):
    router = start_router(RedisHub(f"redis://127.0.0.1:{free_port()}/0"), poll_seconds=0.1)
    health = httpx.get(f"{router.url}/health")
    assert health.json()["models"] == 0
    response = chat(router, auth)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


@pytest.mark.redis
def test_stamps_land_in_the_redis_zset_and_never_move_back(redis_settings, start_router, auth, start_engine):
    hub = get_hub()
    assert isinstance(hub, RedisHub)
    a, b = start_engine("a"), start_engine("b")
    hub.publish_endpoints(make_table([a.url, b.url]))
    client = redis.Redis.from_url(redis_settings)
    future = time.time() + 1000
    # Replica 1 already carries a newer stamp (another router's clock), replica 2 an old one.
    client.zadd(USAGE_KEY, {"1": future, "2": 5.0})
    router = start_router(None, flush_seconds=0.1)  # the settings' hub: Redis
    before = time.time()
    # No prompt, so no prefix affinity: the two requests are taken in turn by the two replicas.
    assert chat(router, auth, messages=[]).headers["x-llmgw-replica"] == "1"
    assert chat(router, auth, messages=[]).headers["x-llmgw-replica"] == "2"
    after = time.time()
    wait_until(lambda: client.zscore(USAGE_KEY, "2") > 5.0, timeout=1.5)
    assert before <= client.zscore(USAGE_KEY, "2") <= after
    assert client.zscore(USAGE_KEY, "1") == future
    assert pending_stamps(router.state.picker) == {}
    client.close()


@pytest.mark.redis
def test_router_follows_tables_published_through_redis(redis_settings, start_router, auth, start_engine):
    hub = get_hub()
    hub.publish_endpoints(make_table())
    router = start_router(None, activation_timeout=3)
    assert router.state.routes.endpoints() == []
    engine = start_engine("pushed")
    hub.publish_endpoints(make_table([engine.url]))
    wait_until(lambda: router.state.routes.endpoints(MODEL), timeout=2)
    assert chat(router, auth).json()["choices"][0]["message"]["content"] == "hello from pushed"


class CancellationToErrorHub(InProcessHub):
    """A store client that answers a cancelled call with an error of its own, as redis-py can."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    async def report_usage(self, report):
        self.calls += 1
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise ConnectionError("connection closed while reading") from None


def test_router_stops_even_when_the_store_turns_cancellation_into_an_error(start_router):
    store = CancellationToErrorHub()
    router = start_router(store, flush_seconds=0.05)
    assert wait_until(lambda: store.calls > 0)
    started = time.monotonic()
    router.stop()  # fails the test if the router thread is still running after the grace
    assert time.monotonic() - started < 5


def run(coro):
    return asyncio.run(coro)


def flusher_on(hub, router_id="r1"):
    """A usage flusher and the picker whose ledger it flushes, over a table of two replicas."""
    picker = new_picker()
    picker.routes.apply_table(make_table(["http://a:1", "http://b:1"]))
    return UsageFlusher(hub, picker.ledger, RouterMetrics(), flush_seconds=1.0, router_id=router_id), picker


def test_one_flush_is_one_report_of_stamps_peaks_and_this_routers_mark():
    hub = CountingHub(InProcessHub())
    flusher, picker = flusher_on(hub)
    first, second = picker.pick(MODEL), picker.pick(MODEL)
    picker.release(first)
    assert run(flusher.flush()) is True
    (report,) = hub.reports
    assert (report.router, report.in_flight, report.ttl) == ("r1", {MODEL: 2}, 3.0)
    assert set(report.stamps) == {first.replica_id, second.replica_id}
    (mark,) = hub.collect_usage().routers
    assert (mark.router, mark.in_flight) == ("r1", {MODEL: 2})
    picker.release(second)
    run(flusher.flush())
    assert hub.reports[-1].in_flight == {MODEL: 1}  # the window started with `second` still in flight
    run(flusher.flush())
    assert hub.reports[-1] == UsageReport(router="r1", stamps={}, in_flight={}, ttl=3.0)


def test_a_failed_flush_keeps_the_stamps_and_drops_the_peaks():
    hub = RedisHub(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens: every report fails
    flusher, picker = flusher_on(hub)
    picker.release(picker.pick(MODEL))
    stamps = pending_stamps(picker)
    assert run(flusher.flush()) is False
    assert pending_stamps(picker) == stamps
    assert picker.ledger.take_usage() == (stamps, {})
    assert flusher.metrics.registry.get_sample_value("llmgw_router_usage_flush_failures_total") == 1


def test_clean_shutdown_flushes_once_more_and_withdraws_the_mark():
    hub = InProcessHub()
    (staying, _), (leaving, picker) = flusher_on(hub, router_id="staying"), flusher_on(hub, router_id="leaving")
    run(staying.flush())
    run(leaving.flush())
    used = picker.pick(MODEL)
    picker.release(used)
    assert run(leaving.close()) is True
    snapshot = hub.collect_usage()
    assert [mark.router for mark in snapshot.routers] == ["staying"]
    assert used.replica_id in snapshot.stamps  # flushed before leaving


def test_a_router_that_cannot_flush_at_shutdown_does_not_leave():
    """Leaving with stamps undelivered would turn "unknown" into "unused": the mark is left to lapse."""
    hub = UnreachableRedisHub(make_table())
    flusher, _ = flusher_on(hub)
    assert run(flusher.close()) is False


def test_router_ids_differ_per_process_start_and_name_the_host():
    first, second = new_router_id(), new_router_id()
    assert first != second
    assert first.split("-")[-2] == str(os.getpid())


def test_a_router_left_after_the_app_stops(start_router, hub, start_engine):
    hub.publish_endpoints(make_table([start_engine().url]))
    router = start_router(hub, flush_seconds=0.05, router_id="app-router")
    wait_until(lambda: [mark.router for mark in hub.collect_usage().routers] == ["app-router"])
    router.stop()
    assert hub.collect_usage().routers == []
