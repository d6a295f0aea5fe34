"""API keys through a real PostgreSQL restart and outage: a private cluster the test creates, stops and starts.

The router's key lookups go to that cluster (as Django database STORE) over
the connection they keep, exactly as they go to the project's database in
production; the shared server is never touched.
"""

import functools

import pytest
from django.contrib.auth.models import Group, Permission, User
from django.contrib.contenttypes.models import ContentType
from django.db import DEFAULT_DB_ALIAS, connections

from hub.credentials import hash_secret
from keys.models import KEY_PREFIX, ApiKey, Budget
from router.key_cache import ApiKeyCache, find_active_key
from router.tests.conftest import Clock, make_table
from router.tests.conftest import chat_with_key as chat
from teams.models import Team

STORE = "router_key_store"


class KeyStore:
    """ApiKey rows in the private PostgreSQL cluster, as Django database `STORE`."""

    def __init__(self, cluster):
        self.cluster = cluster

    def issue(self, name):
        plaintext = f"{KEY_PREFIX}{name}-0123456789abcdef"
        self._write(lambda: ApiKey.objects.using(STORE).create(name=name, prefix=name, key_hash=hash_secret(plaintext)))
        return plaintext

    def revoke(self, plaintext):
        self._write(lambda: ApiKey.objects.using(STORE).filter(key_hash=hash_secret(plaintext)).update(active=False))

    def _write(self, change):
        # The test's own connection died with the server too.
        connections[STORE].close()
        change()


@pytest.fixture
def key_store(private_postgres, django_db_blocker):
    """The private cluster holding the ApiKey table, reachable as database STORE (registered for this test only).

    Not a django_db test: the project's test database is not touched, and STORE is unblocked by hand.
    """
    connections.settings[STORE] = connections.configure_settings(
        {DEFAULT_DB_ALIAS: connections.settings[DEFAULT_DB_ALIAS], STORE: private_postgres.database()}
    )[STORE]
    try:
        with django_db_blocker.unblock():
            with connections[STORE].schema_editor() as editor:
                # The key's table and those its foreign keys name (its holder, with the user's own, and its team), and
                # the budgets read with it.
                for model in (ContentType, Permission, Group, User, Team, ApiKey, Budget):
                    editor.create_model(model)
            yield KeyStore(private_postgres)
            connections[STORE].close()
    finally:
        del connections[STORE]
        del connections.settings[STORE]


def test_keys_are_checked_through_a_real_postgresql_restart_and_outage(key_store, start_router, hub, start_engine):
    kept, soon_revoked = key_store.issue("kept"), key_store.issue("revoked")
    hub.publish_endpoints(make_table([start_engine().url]))
    clock = Clock()
    cache = ApiKeyCache(positive_ttl=30, clock=clock, lookup=functools.partial(find_active_key, using=STORE))
    router = start_router(key_cache=cache)
    assert chat(router, kept).status_code == chat(router, soon_revoked).status_code == 200

    # A restart the router does not see: the connection its lookups keep is dead when it next looks.
    key_store.cluster.stop()
    key_store.cluster.start()
    key_store.revoke(soon_revoked)
    clock.now += 31
    assert chat(router, soon_revoked).status_code == 401  # the first lookup after the restart answers
    assert chat(router, kept).status_code == 200

    # An outage: verified keys keep working past their TTL, a key never seen cannot be verified.
    newcomer = key_store.issue("newcomer")
    key_store.cluster.stop()
    clock.now += 31
    lookups = cache.lookups
    assert chat(router, kept).status_code == 200
    assert cache.lookups == lookups + 1  # asked, failed, answered from memory
    response = chat(router, newcomer)
    assert response.status_code == 503 and response.json()["error"]["code"] == "key_store_unreachable"
    assert chat(router, soon_revoked).status_code == 401  # refused before the outage, refused during it

    key_store.cluster.start()
    clock.now += 1
    assert chat(router, newcomer).status_code == 200
    assert chat(router, kept).status_code == 200
