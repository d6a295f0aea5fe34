"""Last-use stamps (DESIGN invariant 4): flushed once per interval, never per request, never failing a request."""

import asyncio
import time

import httpx
import pytest
import redis

from conftest import free_port, wait_until
from hub import InProcessHub, RedisHub, get_hub
from hub.redis_hub import USAGE_KEY

from .conftest import MODEL, make_table
from .test_proxy import CountingHub, chat, run_concurrently

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
    stamps = wait_until(hub.collect_usage, timeout=1.0)
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
    assert httpx.get(f"{router.url}/health").status_code == 200
    renewed = counting.watch_renewals
    wait_until(lambda: counting.watch_renewals >= renewed + 3)
    assert counting.usage_flushes == []


class UnreachableRedisHub(RedisHub):
    """A RedisHub whose Redis is a closed port; the endpoint table is handed over in memory instead."""

    def __init__(self, table):
        super().__init__(f"redis://127.0.0.1:{free_port()}/0")
        self.table = table

    async def read_endpoints(self):
        return self.table

    async def watch_endpoints(self):
        # Nothing is ever pushed; the startup read is enough.
        if False:
            yield


def test_unreachable_redis_does_not_fail_requests_and_stamps_wait_for_the_next_flush(start_router, auth, start_engine):
    engine = start_engine()
    hub = UnreachableRedisHub({**make_table([engine.url]), "fingerprint": "f"})
    router = start_router(hub, flush_seconds=0.05)
    for _ in range(3):
        assert chat(router, auth).status_code == 200
    registry = router.state.metrics.registry
    wait_until(lambda: (registry.get_sample_value("llmgw_router_usage_flush_failures_total") or 0) >= 2)
    assert list(router.state.balancer.pending_stamps()) == ["1"]
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
    assert chat(router, auth).headers["x-llmgw-replica"] == "1"
    assert chat(router, auth).headers["x-llmgw-replica"] == "2"
    after = time.time()
    wait_until(lambda: client.zscore(USAGE_KEY, "2") > 5.0, timeout=1.5)
    assert before <= client.zscore(USAGE_KEY, "2") <= after
    assert client.zscore(USAGE_KEY, "1") == future
    assert router.state.balancer.pending_stamps() == {}
    client.close()


@pytest.mark.redis
def test_router_follows_tables_published_through_redis(redis_settings, start_router, auth, start_engine):
    hub = get_hub()
    hub.publish_endpoints(make_table())
    router = start_router(None, activation_timeout=3)
    assert router.state.balancer.endpoints() == []
    engine = start_engine("pushed")
    hub.publish_endpoints(make_table([engine.url]))
    wait_until(lambda: router.state.balancer.endpoints(MODEL), timeout=2)
    assert chat(router, auth).json()["choices"][0]["message"]["content"] == "hello from pushed"


class CancellationToErrorHub(InProcessHub):
    """A store client that answers a cancelled call with an error of its own, as redis-py can."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    async def keep_watching(self, ttl):
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
