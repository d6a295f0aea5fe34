"""Fixtures of the agent link tests."""

import pytest

from agentlink import batches, consumers


@pytest.fixture(autouse=True)
def fresh_batches(monkeypatch):
    """Each test starts with empty heartbeat and ack batches: one left by another test's ended loop
    would carry its items (and their time) into this one."""
    for name in ("seen_nodes", "acks"):
        original = getattr(batches, name)
        fresh = batches.Batch(original.name, original._write, original._interval)
        monkeypatch.setattr(batches, name, fresh)
        monkeypatch.setattr(consumers, name, fresh)
