"""Fixtures of the agent link tests."""

import pytest

from agentlink import batches, consumers


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
