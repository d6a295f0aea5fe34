"""Heartbeats' `last_seen`, batched: one UPDATE per control-plane process per flush interval.

A heartbeat used to write its node's row; at a thousand nodes that is
hundreds of writes a second on the one thread database work runs on. Here a
heartbeat only adds its node to a set, and every LLMGW_LAST_SEEN_FLUSH_SECONDS
the set is written in one UPDATE, stamped with the time the batch began.
So a node's `last_seen` is never later than its last heartbeat and at most two
flush intervals older than it (the batch's age plus the wait for the write):
with the defaults about 2 s against the 20 s reconciler.liveness allows before
calling a node unreachable. A failed write keeps the set for the next flush.
"""

from __future__ import annotations

import asyncio
import logging

from channels.db import database_sync_to_async
from django.conf import settings
from django.utils import timezone

from inventory.services import mark_nodes_seen

log = logging.getLogger(__name__)


class SeenNodes:
    """Nodes heard from since the last flush; `mark()` from the event loop, a task of that loop flushes."""

    def __init__(self) -> None:
        self._ids: set[int] = set()
        self._since = None
        self._task: asyncio.Task | None = None

    def mark(self, node_id: int) -> None:
        """Node `node_id` was heard from now; it is written with the next flush."""
        if not self._ids:
            self._since = timezone.now()
        self._ids.add(node_id)
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._flush_while_marked(), name="last-seen-flush")

    async def _flush_while_marked(self) -> None:
        # Runs only while there is something to write, so an idle process (or a test's loop) keeps no task.
        while self._ids:
            await asyncio.sleep(settings.LLMGW_LAST_SEEN_FLUSH_SECONDS)
            await self.flush()

    async def flush(self) -> int:
        """Write the marked nodes now; returns how many rows were updated."""
        ids, since = self._ids, self._since
        self._ids, self._since = set(), None
        if not ids:
            return 0
        try:
            return await database_sync_to_async(mark_nodes_seen)(ids, since)
        except Exception as exc:  # the database is away: keep them, the next flush tries again
            log.warning("could not record %d nodes' heartbeats: %s", len(ids), exc)
            self._ids |= ids
            self._since = min(since, self._since) if self._since else since
            return 0


# One per process: every agent stream this process holds marks its node here.
seen_nodes = SeenNodes()
