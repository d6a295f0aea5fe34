"""The router's API-key cache against real ApiKey rows: the database is asked only on a miss."""

import asyncio

import pytest

from hub.credentials import hash_secret
from router.keys import ApiKeyCache
from router.models import KEY_PREFIX, ApiKey

pytestmark = pytest.mark.django_db(transaction=True)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def check(cache, *keys):
    """Ask the cache about each key in turn on a fresh loop; close its database thread afterwards."""

    async def run():
        try:
            return [await cache.is_valid(key) for key in keys]
        finally:
            await cache.close()

    return asyncio.run(run())


def test_an_issued_key_is_stored_only_as_its_hash_and_prefix():
    api_key, plaintext = ApiKey.issue("hashed")
    assert plaintext.startswith(KEY_PREFIX) and len(plaintext) > len(KEY_PREFIX) + 32
    api_key.refresh_from_db()
    assert api_key.key_hash == hash_secret(plaintext) != plaintext
    assert api_key.prefix == plaintext[: len(KEY_PREFIX) + 6]


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
            return await asyncio.gather(*(cache.is_valid(key) for _ in range(20)))
        finally:
            await cache.close()

    assert asyncio.run(run()) == [True] * 20
    assert cache.lookups == 1


def test_a_flood_of_distinct_wrong_keys_does_not_grow_the_cache_without_bound():
    cache = ApiKeyCache(max_entries=10)
    check(cache, *(f"sk-wrong-{i}" for i in range(25)))
    assert len(cache._entries) <= 10
