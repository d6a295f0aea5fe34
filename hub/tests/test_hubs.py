"""The hub's contract, run against both backends: in-process and the real Redis."""

import asyncio
import time

import pytest
import redis

from conftest import wait_until
from hub import InProcessHub, RedisHub, fingerprint
from hub.redis_hub import WATCH_KEY


@pytest.fixture(params=["in-process", "redis"])
def hub(request):
    if request.param == "in-process":
        return InProcessHub()
    return RedisHub(request.getfixturevalue("redis_url"))


def run(coro):
    return asyncio.run(coro)


TABLE = {"models": {"llama": {"aliases": ["l"]}}, "endpoints": []}


def test_an_endpoint_table_is_published_only_when_it_changes(hub):
    """DESIGN invariant 7."""
    assert hub.publish_endpoints(TABLE) is True
    assert hub.publish_endpoints(dict(TABLE)) is False
    changed = {**TABLE, "endpoints": [{"replica_id": "1", "model": "llama", "url": "http://127.0.0.1:1"}]}
    assert hub.publish_endpoints(changed) is True
    published = run(hub.read_endpoints())
    assert published["fingerprint"] == fingerprint(changed)
    assert published["endpoints"] == changed["endpoints"]


def test_activations_are_drained_once_however_often_asked(hub):
    async def ask():
        await asyncio.gather(*(hub.request_activation("llama") for _ in range(5)), hub.request_activation("qwen"))

    run(ask())
    assert hub.drain_activations() == {"llama", "qwen"}
    assert hub.drain_activations() == set()


def test_usage_keeps_the_newest_stamp_and_forgets_on_request(hub):
    """DESIGN invariant 4: newest wins, whatever order routers flush in."""
    run(hub.record_usage({"1": 200.0, "2": 50.0}))
    run(hub.record_usage({"1": 100.0, "2": 60.0}))
    assert hub.collect_usage() == {"1": 200.0, "2": 60.0}
    hub.forget_usage(["2"])
    assert hub.collect_usage() == {"1": 200.0}


class FakeClock:
    """Unix time that moves only when a test says so."""

    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_in_process_watch_holds_while_renewed_and_restarts_after_a_lapse():
    clock = FakeClock()
    hub = InProcessHub(clock=clock)
    assert hub.watching_since() is None
    run(hub.keep_watching(1.0))
    since = hub.watching_since()
    assert since == clock.now
    clock.now += 0.9
    run(hub.keep_watching(1.0))
    clock.now += 0.9
    assert hub.watching_since() == since  # renewed, not restarted
    clock.now += 0.2
    assert hub.watching_since() is None  # every router went quiet: unknown again
    run(hub.keep_watching(1.0))
    assert hub.watching_since() == clock.now > since


def _age_watch_mark(redis_url: str, left_ms: int) -> None:
    """Make the Redis watch mark expire in `left_ms`, as if its TTL had mostly run out."""
    client = redis.Redis.from_url(redis_url)
    client.pexpire(WATCH_KEY, left_ms)
    client.close()


def test_redis_watch_holds_while_renewed_and_restarts_after_a_lapse(redis_url):
    hub = RedisHub(redis_url)
    assert hub.watching_since() is None
    before = time.time()
    run(hub.keep_watching(60.0))
    since = hub.watching_since()
    assert since is not None and before <= since <= time.time()
    _age_watch_mark(redis_url, 50)
    run(hub.keep_watching(60.0))
    assert hub.watching_since() == since  # renewed, not restarted
    _age_watch_mark(redis_url, 1)
    wait_until(lambda: hub.watching_since() is None, 3.0, 0.01)  # every router went quiet: unknown again
    run(hub.keep_watching(60.0))
    assert hub.watching_since() > since


def test_two_routers_share_one_watch(redis_url):
    first, second = RedisHub(redis_url), RedisHub(redis_url)
    run(first.keep_watching(60.0))
    since = first.watching_since()
    for _ in range(3):  # the first router stops; the second alone keeps the mark alive
        _age_watch_mark(redis_url, 50)
        run(second.keep_watching(60.0))
        assert 59_000 < redis.Redis.from_url(redis_url).pttl(WATCH_KEY) <= 60_000
    assert second.watching_since() == since


def test_an_activation_request_calls_the_in_process_listeners():
    hub, calls = InProcessHub(), []
    hub.on_activation(lambda: calls.append("woken"))
    run(hub.request_activation("llama"))
    assert calls == ["woken"]
    assert hub.drain_activations() == {"llama"}
