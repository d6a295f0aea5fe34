"""Key changes reach every router within a second: saved or deleted through the ORM (or revoked by the
admin's bulk action), pushed through the hub (in-process and Redis), dropped from each router's cache."""

import asyncio
import threading
import time

import pytest
import redis
from django.utils import timezone

from conftest import wait_until
from hub import RedisHub, get_hub
from hub.credentials import hash_secret
from keys.changes import set_keys_active
from keys.models import ApiKey
from router.key_cache import ApiKeyCache, KeyInfo
from router.tests.conftest import chat_with_key, make_table

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(params=["in-process", "redis"])
def two_routers(request, start_router, start_engine):
    """Two routers on the settings' hub, each with its own hub client (as two processes would have)."""
    if request.param == "redis":
        url = request.getfixturevalue("redis_settings")
        hubs = [RedisHub(url), RedisHub(url)]
        listeners = redis.Redis.from_url(url)

        def subscribed():
            return listeners.pubsub_numsub(hubs[0].key_changes_channel)[0][1] >= 2
    else:
        hubs = [get_hub(), get_hub()]  # embedded: the routers share the process's hub with the control plane

        def subscribed():
            return len(get_hub()._key_watchers) >= 2

    get_hub().publish_endpoints(make_table([start_engine().url]))
    routers = [start_router(hub) for hub in hubs]
    wait_until(subscribed, timeout=5)
    return routers


def refused_by_all_within(routers, key, seconds=1.0) -> float:
    started = time.monotonic()
    for router in routers:
        wait_until(lambda r=router: chat_with_key(r, key).status_code == 401, timeout=seconds)
    return time.monotonic() - started


def test_a_key_revoked_through_the_orm_is_refused_by_every_router_within_a_second(two_routers):
    api_key, key = ApiKey.issue("soon revoked")
    assert all(chat_with_key(router, key).status_code == 200 for router in two_routers)  # cached now (30 s TTL)
    api_key.active = False
    api_key.save()
    assert refused_by_all_within(two_routers, key) < 1.0


def test_a_deleted_key_is_refused_by_every_router_within_a_second(two_routers):
    api_key, key = ApiKey.issue("soon deleted")
    assert all(chat_with_key(router, key).status_code == 200 for router in two_routers)
    api_key.delete()
    assert refused_by_all_within(two_routers, key) < 1.0


def test_the_admins_bulk_revoke_is_pushed_too(two_routers):
    _, key = ApiKey.issue("bulk")
    assert all(chat_with_key(router, key).status_code == 200 for router in two_routers)
    assert set_keys_active(ApiKey.objects.filter(name="bulk"), False) == 1
    assert refused_by_all_within(two_routers, key) < 1.0
    assert set_keys_active(ApiKey.objects.filter(name="bulk"), False) == 0  # already revoked: nothing to push


def test_a_scope_change_applies_within_a_second(two_routers):
    api_key, key = ApiKey.issue("narrowed")
    assert chat_with_key(two_routers[0], key).status_code == 200
    api_key.allowed_models = ["some-other-model"]
    api_key.save()
    wait_until(lambda: chat_with_key(two_routers[0], key).status_code == 403, timeout=1.0)


def test_a_new_key_is_accepted_at_once_even_if_it_was_just_refused(two_routers):
    key = "sk-imported-from-another-gateway-0001"
    assert chat_with_key(two_routers[0], key).status_code == 401  # remembered as unknown for 5 s
    ApiKey.issue("imported", key)
    wait_until(lambda: chat_with_key(two_routers[0], key).status_code == 200, timeout=1.0)


def test_writing_only_the_last_use_pushes_nothing(start_router):
    router = start_router(None)
    wait_until(lambda: get_hub()._key_watchers, timeout=5)
    used, _ = ApiKey.issue("used")
    wait_until(lambda: router.state.keys.changes_heard == 1)
    used.last_used_at = timezone.now()
    used.save(update_fields=["last_used_at"])
    ApiKey.issue("other")
    wait_until(lambda: router.state.keys.changes_heard >= 2)
    time.sleep(0.1)
    assert router.state.keys.changes_heard == 2


def test_a_change_heard_while_its_lookup_runs_is_not_cached():
    release = threading.Event()
    entered = threading.Event()

    def slow_lookup(digest):
        entered.set()
        release.wait(5)
        return KeyInfo(1, "old row", digest)

    cache = ApiKeyCache(lookup=slow_lookup)

    async def run():
        try:
            first = asyncio.ensure_future(cache.check("sk-racing"))
            await asyncio.get_running_loop().run_in_executor(None, entered.wait, 5)
            cache.forget_digests([hash_secret("sk-racing")])
            release.set()
            assert (await first) is not None  # the request that asked gets its answer...
            await cache.check("sk-racing")  # ...but the next one reads the row again
        finally:
            await cache.close()

    asyncio.run(run())
    assert cache.lookups == 2
