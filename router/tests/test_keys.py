"""The router's API-key cache against real ApiKey rows: the database is asked only on a miss, and
an unreachable key store (an injected lookup failing as Django does) leaves verified keys working.
test_key_store_outage.py does the same against a real PostgreSQL stopped and started."""

import asyncio
import threading
import time

import pytest
from django.db import OperationalError

from hub.credentials import hash_secret
from keys.models import ApiKey
from router.key_cache import ApiKeyCache, KeyInfo, KeyStoreUnreachable
from router.tests.conftest import Clock, make_table
from router.tests.conftest import chat_with_key as chat

pytestmark = pytest.mark.django_db(transaction=True)


async def is_valid(cache, key):
    """Whether `key` belongs to an active ApiKey (expiry aside), as the cache answers."""
    return await cache.check(key) is not None


def check(cache, *keys):
    """Ask the cache about each key in turn on a fresh loop; close its database thread afterwards."""

    async def run():
        try:
            return [await cache.check(key) is not None for key in keys]
        finally:
            await cache.close()

    return asyncio.run(run())


def test_valid_key_is_looked_up_once_then_answered_from_memory():
    _, key = ApiKey.issue("a")
    cache = ApiKeyCache()
    assert check(cache, key, key, key) == [True, True, True]
    assert cache.lookups == 1


def test_unknown_key_is_remembered_only_for_the_negative_ttl():
    clock = Clock()
    cache = ApiKeyCache(negative_ttl=5, clock=clock)
    assert check(cache, "sk-nope", "sk-nope") == [False, False]
    assert cache.lookups == 1
    clock.now += 5.1
    assert check(cache, "sk-nope") == [False]
    assert cache.lookups == 2


def test_revoked_key_is_refused_once_its_positive_entry_expires():
    clock = Clock()
    api_key, key = ApiKey.issue("soon revoked")
    cache = ApiKeyCache(positive_ttl=30, clock=clock)
    assert check(cache, key) == [True]
    ApiKey.objects.filter(pk=api_key.pk).update(active=False)
    assert check(cache, key) == [True]  # still within the 30 s it was cached for
    clock.now += 31
    assert check(cache, key) == [False]


def test_concurrent_misses_for_one_key_share_one_lookup():
    _, key = ApiKey.issue("busy")
    cache = ApiKeyCache()

    async def run():
        try:
            return await asyncio.gather(*(is_valid(cache, key) for _ in range(20)))
        finally:
            await cache.close()

    assert asyncio.run(run()) == [True] * 20
    assert cache.lookups == 1


def test_a_flood_of_distinct_wrong_keys_does_not_grow_the_cache_without_bound():
    cache = ApiKeyCache(max_entries=10)
    check(cache, *(f"sk-wrong-{i}" for i in range(25)))
    assert len(cache._entries) <= 10
    assert len(cache._digests) <= 10  # nor the tokens remembered with their digests


# -- the key store unreachable -------------------------------------------------------------------


class FlakyStore:
    """A key lookup the test can take down: while `down`, it raises what Django raises for a dead database."""

    def __init__(self, *valid_keys):
        self.valid = {hash_secret(k) for k in valid_keys}
        self.down = False
        self.asked = 0

    def __call__(self, digest):
        self.asked += 1
        if self.down:
            raise OperationalError("connection refused")
        return KeyInfo(1, "flaky", digest) if digest in self.valid else None


def test_a_verified_key_keeps_working_while_the_key_store_is_unreachable():
    clock, store = Clock(), FlakyStore("sk-good")
    cache = ApiKeyCache(positive_ttl=30, clock=clock, lookup=store)
    assert check(cache, "sk-good") == [True]
    store.down = True
    clock.now += 31  # far past the positive TTL
    assert check(cache, "sk-good", "sk-good") == [True, True]
    clock.now += 600
    assert check(cache, "sk-good") == [True]
    assert store.asked == 3  # it was asked again (and failed), not skipped


def test_a_revocation_applies_again_once_the_key_store_answers():
    clock, store = Clock(), FlakyStore("sk-good")
    cache = ApiKeyCache(positive_ttl=30, clock=clock, lookup=store, retry_seconds=1)
    assert check(cache, "sk-good") == [True]
    store.down = True
    clock.now += 31
    assert check(cache, "sk-good") == [True]
    store.valid.clear()  # revoked during the outage
    store.down = False
    clock.now += 1
    assert check(cache, "sk-good", "sk-good") == [False, False]


def test_a_key_never_verified_is_refused_as_unverifiable_while_the_key_store_is_unreachable():
    clock, store = Clock(), FlakyStore("sk-new")
    store.down = True
    cache = ApiKeyCache(clock=clock, lookup=store)
    with pytest.raises(KeyStoreUnreachable, match="key store is unreachable"):
        check(cache, "sk-new")
    store.down = False
    clock.now += 1
    assert check(cache, "sk-new") == [True]


def test_a_key_refused_before_the_outage_stays_refused_during_it():
    clock, store = Clock(), FlakyStore()
    cache = ApiKeyCache(negative_ttl=5, clock=clock, lookup=store)
    assert check(cache, "sk-wrong") == [False]
    store.down = True
    clock.now += 6
    assert check(cache, "sk-wrong") == [False]


def test_after_a_failed_lookup_the_key_store_is_left_alone_for_retry_seconds():
    clock, store = Clock(), FlakyStore("sk-good")
    cache = ApiKeyCache(positive_ttl=30, clock=clock, lookup=store, retry_seconds=1)
    assert check(cache, "sk-good") == [True]
    store.down = True
    clock.now += 31
    assert check(cache, "sk-good") == [True]
    asked = store.asked
    assert check(cache, *["sk-good"] * 50) == [True] * 50
    with pytest.raises(KeyStoreUnreachable):
        check(cache, "sk-other")
    assert store.asked == asked  # neither the known key nor the unknown one asked again within the second
    clock.now += 1
    assert check(cache, "sk-good") == [True]
    assert store.asked == asked + 1


def test_concurrent_requests_during_an_outage_share_one_lookup_and_all_get_the_last_answer():
    clock, store = Clock(), FlakyStore("sk-good")
    cache = ApiKeyCache(positive_ttl=30, clock=clock, lookup=store)
    assert check(cache, "sk-good") == [True]
    store.down = True
    clock.now += 31

    async def run():
        try:
            return await asyncio.gather(*(is_valid(cache, "sk-good") for _ in range(20)))
        finally:
            await cache.close()

    assert asyncio.run(run()) == [True] * 20
    assert store.asked == 2


def test_a_lookup_that_hangs_is_waited_for_only_lookup_timeout():
    clock = Clock()
    answered = threading.Event()
    store = FlakyStore("sk-good")

    def hanging(digest):
        if store.asked:
            answered.wait(5)
        return store(digest)

    cache = ApiKeyCache(positive_ttl=30, clock=clock, lookup=hanging, lookup_timeout=0.2)
    assert check(cache, "sk-good") == [True]
    clock.now += 31

    async def run():
        try:
            verified = await is_valid(cache, "sk-good")  # waits 0.2 s, then answers from memory
            with pytest.raises(KeyStoreUnreachable):
                await is_valid(cache, "sk-unknown")  # the stuck store is not even asked
            answered.set()
            return verified
        finally:
            await cache.close()

    started = time.monotonic()
    assert asyncio.run(run()) is True
    assert time.monotonic() - started < 3


def test_an_unknown_key_is_503_in_openai_shape_while_the_key_store_is_unreachable(start_router, hub, start_engine):
    store = FlakyStore("sk-good")
    hub.publish_endpoints(make_table([start_engine().url]))
    clock = Clock()
    router = start_router(key_cache=ApiKeyCache(clock=clock, lookup=store))
    assert chat(router, "sk-good").status_code == 200
    store.down = True
    clock.now += 31
    assert chat(router, "sk-good").status_code == 200
    response = chat(router, "sk-never-seen")
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json() == {
        "error": {
            "message": "Cannot verify the API key: the key store is unreachable. Retry shortly.",
            "type": "server_error",
            "param": None,
            "code": "key_store_unreachable",
        }
    }


def test_verified_keys_outlive_a_flood_of_wrong_keys_for_the_next_outage():
    clock, store = Clock(), FlakyStore("sk-good")
    cache = ApiKeyCache(positive_ttl=30, negative_ttl=5, max_entries=10, clock=clock, lookup=store)
    assert check(cache, "sk-good") == [True]
    clock.now += 31
    check(cache, *(f"sk-wrong-{i}" for i in range(25)))  # the cache fills up with wrong keys, twice over
    assert len(cache._entries) <= 10
    store.down = True
    assert check(cache, "sk-good") == [True]
