"""Fixtures of the agent link tests."""

import pytest
import pytest_asyncio
from channels.db import database_sync_to_async
from django.db import connections

from agentlink import batches, consumers
from inventory.services import enrol_node


@pytest.fixture(autouse=True)
def fresh_batches(monkeypatch):
    """Each test starts with empty batches (heartbeats, acks, shard reports, hellos): one left by another
    test's ended loop would carry its items (and their time) into this one."""
    for name in ("seen_nodes", "acks", "shard_statuses"):
        original = getattr(batches, name)
        fresh = batches.Batch(original.name, original._write, original._interval, original.distinct)
        monkeypatch.setattr(batches, name, fresh)
        monkeypatch.setattr(consumers, name, fresh)
    fresh_hellos = batches.GroupCommit(batches.hellos.name, batches.hellos._write_many, batches.hellos.gather_seconds)
    monkeypatch.setattr(batches, "hellos", fresh_hellos)
    monkeypatch.setattr(consumers, "hellos", fresh_hellos)


@pytest_asyncio.fixture
async def close_consumer_connection():
    """Close the database connection of the thread the consumer's queries ran on.

    Left open, it keeps the PostgreSQL test database busy at teardown.
    """
    yield
    await database_sync_to_async(connections.close_all)()


@pytest.fixture
def token():
    """The credential of node gpu-a, freshly enrolled."""
    return enrol_node("gpu-a")[1]
