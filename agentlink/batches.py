"""Agent reports that need no answer, written in batches: one statement per flush, not one per message.

At a thousand nodes, heartbeats and acks arrive by the hundred a second, and
database work runs on few threads. Two things are batched per control-plane process:

* `last_seen`: a heartbeat only adds its node to a set, written in one UPDATE
  every LLMGW_LAST_SEEN_FLUSH_SECONDS, stamped with the time the batch began.
  So a node's `last_seen` is never later than its last heartbeat and at most two
  flush intervals older than it (the batch's age plus the wait for the write):
  with the defaults about 2 s against the 20 s reconciler.liveness allows
  before calling a node unreachable.
* acks: gathered for ACK_FLUSH_SECONDS and deleted from the pending commands in
  one statement; a command is first re-sent after about a second, so 0.1 s
  of delay re-sends nothing.

A failed write keeps the batch for the next flush.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings
from django.utils import timezone

from inventory.services import mark_nodes_seen
from reconciler.commands import acknowledge_many

log = logging.getLogger(__name__)

ACK_FLUSH_SECONDS = 0.1


class Batch:
    """Items gathered on the event loop and written by `write(items, since)` every `interval()` seconds.

    A task of the loop flushes only while something is waiting, so an idle
    process (or a test's short-lived loop) keeps no task.
    """

    def __init__(self, name: str, write: Callable[[set, Any], int], interval: Callable[[], float]) -> None:
        self.name = name
        self._write = write
        self._interval = interval
        self._items: set = set()
        self._since = None
        self._task: asyncio.Task | None = None

    def add(self, item) -> None:
        """Write `item` with the next flush."""
        if not self._items:
            self._since = timezone.now()
        self._items.add(item)
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._flush_while_waiting(), name=f"{self.name}-flush")

    async def _flush_while_waiting(self) -> None:
        while self._items:
            await asyncio.sleep(self._interval())
            await self.flush()

    async def flush(self) -> int:
        """Write what is waiting now; returns what `write` returned (0 on failure)."""
        items, since = self._items, self._since
        self._items, self._since = set(), None
        if not items:
            return 0
        try:
            return await database_sync_to_async(self._write)(items, since)
        except Exception as exc:  # the database is away: keep them, the next flush tries again
            log.warning("could not write %d %s: %s", len(items), self.name, exc)
            self._items |= items
            self._since = min(since, self._since) if self._since else since
            return 0


# One of each per process: every agent stream this process holds adds to them.
seen_nodes = Batch("node heartbeats", mark_nodes_seen, lambda: settings.LLMGW_LAST_SEEN_FLUSH_SECONDS)
acks = Batch("acks", lambda items, _: acknowledge_many(items), lambda: ACK_FLUSH_SECONDS)
