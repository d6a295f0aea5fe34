"""Fixtures shared by every app's tests."""

import os
import socket
import time

import pytest


def redis_url_for_worker(url: str, worker: str) -> str:
    """The Redis database a pytest-xdist worker's tests may flush: `url`'s for the first worker (gw0), and two
    below it for each next one, so two passes side by side on neighbouring databases (15 and 14) never share
    one: gw1 of the pass on 15 flushes 13, gw1 of the pass on 14 flushes 12."""
    base, _, db = url.rpartition("/")
    index = int(worker.removeprefix("gw") or 0)
    if not index:
        return url
    if not db.isdigit() or int(db) - 2 * index < 0:
        raise ValueError(f"REDIS_TEST_URL {url!r} leaves no database for xdist worker {worker}")
    return f"{base}/{int(db) - 2 * index}"


# Without REDIS_TEST_URL (a run by hand, the end-to-end pass): databases 10 and 8, none of those the unit passes of
# `make test` flush (15, 13 and 14, 12), so a run by hand beside the suite never empties one of its databases.
DEFAULT_REDIS_TEST_URL = "redis://127.0.0.1:6379/10"
REDIS_TEST_URL = redis_url_for_worker(
    os.environ.get("REDIS_TEST_URL", DEFAULT_REDIS_TEST_URL), os.environ.get("PYTEST_XDIST_WORKER", "gw0")
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_port_range(block: int) -> str:
    """LLMGW_ENGINE_PORT_RANGE for a stack a test starts: 100 ports of its own. Each pytest-xdist worker has a
    thousand (21000 + 1000 × its number, clear of the default range's first ports that other stacks, the fault
    drill's say, start from) and each kind of stack its `block` (0-9) of them, so two workers' stacks, or an
    engine a stack left stopping, never meet on a port."""
    if not 0 <= block <= 9:
        raise ValueError(f"block must be 0-9, not {block}")
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    low = 21000 + 1000 * worker + 100 * block
    return f"{low}-{low + 99}"


def wait_until(predicate, timeout: float = 3.0, interval: float = 0.01, describe=None):
    """Return predicate()'s first truthy value, or fail after `timeout` seconds.

    `describe`, if given, is called on failure for context (a log, a status).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            context = f":\n{describe()}" if describe else ""
            raise AssertionError(f"condition not met within {timeout} s{context}")
        time.sleep(interval)


def migrate_to(targets=None):
    """Migrate the test database to `targets` ([(app, migration or None)]; every leaf when None) and return
    the historical models of that state (an app registry), as a migration sees them."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    targets = targets or executor.loader.graph.leaf_nodes()
    executor.migrate(targets)
    # (app, None) means "none of app's migrations": it adds nothing to the state.
    return executor.loader.project_state([target for target in targets if target[1] is not None]).apps


# The fixtures through which a test reaches the database (pytest-django refuses it any other way).
DATABASE_FIXTURES = frozenset({"db", "transactional_db", "django_db_reset_sequences", "django_db_serialized_rollback"})


def uses_database(item) -> bool:
    """Whether a collected test reaches the database: a django_db mark, or a fixture that needs one."""
    return item.get_closest_marker("django_db") is not None or not DATABASE_FIXTURES.isdisjoint(item.fixturenames)


def pytest_collection_modifyitems(config, items):
    """Leave out what one pass of the suite does not need.

    On SQLite: the PostgreSQL-only scenarios (they run in the PostgreSQL pass).
    With LLMGW_TEST_DATABASE_ONLY=1 (the Makefile's PostgreSQL pass): every test
    that never reaches the database, which the SQLite pass has run already.
    """
    from django.conf import settings

    sqlite = settings.DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3"
    database_only = os.environ.get("LLMGW_TEST_DATABASE_ONLY", "") == "1"
    kept, left_out = [], []
    for item in items:
        leave_out = (sqlite and item.get_closest_marker("postgres_only")) or (database_only and not uses_database(item))
        (left_out if leave_out else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


@pytest.fixture
def redis_url():
    """The real Redis server, on a database of its own, emptied before and after."""
    import redis

    client = redis.Redis.from_url(REDIS_TEST_URL)
    client.flushdb()
    yield REDIS_TEST_URL
    client.flushdb()
    client.close()


@pytest.fixture
def redis_settings(settings, redis_url):
    """Distributed mode for one test: REDIS_URL set and a fresh hub."""
    from hub import reset_hub

    settings.REDIS_URL = redis_url
    reset_hub()
    yield redis_url
    reset_hub()


@pytest.fixture(autouse=True, scope="session")
def _quick_password_hashing():
    """Test users' passwords are hashed with a quick hasher: PBKDF2's cost (about 0.3 s a password, on purpose) is
    nothing a test checks, and tests create hundreds of users. Processes a test starts keep the real hashers."""
    from django.test.utils import override_settings

    with override_settings(PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"]):
        yield


@pytest.fixture(autouse=True, scope="session")
def _postgresql_flush_by_delete():
    """A transactional test's tables are emptied on PostgreSQL by DELETE, not Django's TRUNCATE of every table:
    a TRUNCATE makes new files for each table, about 0.1-0.3 s a test here, where DELETE on a test's few rows takes
    a millisecond. Django's foreign keys on PostgreSQL are deferred to the commit of the flush's transaction, so
    the order of the tables does not matter. Nothing outside the test harness flushes."""
    from django.db.backends.postgresql.operations import DatabaseOperations

    truncate = DatabaseOperations.sql_flush

    def delete_rows(self, style, tables, *, reset_sequences=False, allow_cascade=False):
        if reset_sequences:
            return truncate(self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade)
        return [f"{style.SQL_KEYWORD('DELETE FROM')} {style.SQL_FIELD(self.quote_name(table))};" for table in tables]

    DatabaseOperations.sql_flush = delete_rows
    yield
    DatabaseOperations.sql_flush = truncate


@pytest.fixture(autouse=True)
def _agent_state_in_tmp(tmp_path, monkeypatch):
    """Agents started by a test keep their state in the test's own directory, never in the user's."""
    monkeypatch.setenv("LLMGW_AGENT_STATE_DIR", str(tmp_path / "agent-state"))


@pytest.fixture(autouse=True)
def _fresh_hub():
    """Each test starts with an empty embedded hub."""
    from hub import reset_hub

    reset_hub()
    yield
    reset_hub()
