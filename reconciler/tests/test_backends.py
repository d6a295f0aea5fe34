"""The hub's contract, run against both backends: in-process and the real Redis."""

import asyncio
import time

import pytest

from conftest import wait_until
from reconciler.backends import InProcessHub, RedisHub, fingerprint


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


def test_watching_since_holds_while_renewed_and_restarts_after_a_lapse(hub):
    assert hub.watching_since() is None
    before = time.time()
    run(hub.keep_watching(1.0))
    since = hub.watching_since()
    assert since is not None and before <= since <= time.time()
    time.sleep(0.1)
    run(hub.keep_watching(1.0))
    assert hub.watching_since() == since  # renewed, not restarted
    wait_until(lambda: hub.watching_since() is None, 3.0, 0.05)  # every router went quiet: unknown again
    run(hub.keep_watching(1.0))
    assert hub.watching_since() > since


def test_two_routers_share_one_watch(redis_url):
    first, second = RedisHub(redis_url), RedisHub(redis_url)
    run(first.keep_watching(1.0))
    since = first.watching_since()
    for _ in range(3):  # the first router stops; the second alone keeps the mark alive
        time.sleep(0.4)
        run(second.keep_watching(1.0))
    assert second.watching_since() == since
