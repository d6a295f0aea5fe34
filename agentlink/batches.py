"""Agent reports that need no answer, written in batches: one statement per flush, not one per message.

At a thousand nodes, heartbeats and acks arrive by the hundred a second, and
database work runs on few threads. Two things are batched per control-plane process:

* `last_seen`: a heartbeat only adds its node to a set, written in one UPDATE
  every LLMGW_LAST_SEEN_FLUSH_SECONDS, stamped with the time the batch began.
  So a node's `last_seen` is never later than its last heartbeat and at most two
  flush intervals older than it (the batch's age plus the wait for the write):
  with the defaults about 2 s against the 20 s reconciler.lifecycle.liveness allows
  before calling a node unreachable.
* acks: gathered for ACK_FLUSH_SECONDS and deleted from the pending commands in
  one statement; a command is first re-sent after about a second, so 0.1 s
  of delay re-sends nothing.

* shard_status reports: gathered for SHARD_STATUS_FLUSH_SECONDS and applied in
  arrival order in one transaction (reconciler.agent_reports.record_shard_statuses),
  so a tick's burst of starts or stops is answered by a few transactions, not a
  thousand, while the event loop relays the rest of the burst.

A failed write keeps the batch, ahead of what arrived since, for the next flush.

Hellos need an answer (the stream's next messages wait for theirs), so they are
gathered by a `GroupCommit`: written together, each sender waiting for its own
outcome. A connect storm of a thousand nodes is then some tens of transactions
of a few statements each, not a thousand of a dozen.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings
from django.utils import timezone

from agentlink.services import on_hellos
from inventory.services import mark_nodes_seen
from reconciler.agent_reports import record_shard_statuses
from reconciler.commands import acknowledge_many

log = logging.getLogger(__name__)

ACK_FLUSH_SECONDS = 0.1
# A replica is published when its shards report ready: 50 ms later is unnoticeable next to an engine's start.
SHARD_STATUS_FLUSH_SECONDS = 0.05


class Batch:
    """Items gathered on the event loop and written by `write(items, since)` every `interval()` seconds.

    Items are kept in arrival order; with `distinct` an item already waiting is
    not added twice (a node's heartbeats, an ack sent again). A task of the loop
    flushes only while something is waiting, so an idle process (or a test's
    short-lived loop) keeps no task.
    """

    def __init__(
        self, name: str, write: Callable[[list, Any], int | None], interval: Callable[[], float], distinct: bool = True
    ) -> None:
        self.name = name
        self._write = write
        self._interval = interval
        self.distinct = distinct
        self._items: list = []
        self._waiting: set = set()
        self._since: datetime | None = None
        self._task: asyncio.Task | None = None

    def add(self, item) -> None:
        """Write `item` with the next flush."""
        if not self._items:
            self._since = timezone.now()
        if self.distinct:
            if item in self._waiting:
                return
            self._waiting.add(item)
        self._items.append(item)
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
        self._items, self._waiting, self._since = [], set(), None
        if not items:
            return 0
        try:
            return await database_sync_to_async(self._write)(items, since) or 0
        except Exception as exc:  # the database is away: keep them, the next flush tries again
            log.warning("could not write %d %s: %s", len(items), self.name, exc)
            if self.distinct:
                kept = set(items)
                self._items = items + [item for item in self._items if item not in kept]
                self._waiting = set(self._items)
            else:
                self._items = items + self._items
            self._since = min(since, self._since) if self._since else since
            return 0


class GroupCommit:
    """Items written together by `write_many(items)` (one result per item), each sender awaiting its own.

    The first item after a quiet spell waits `gather_seconds` for company;
    items that arrive while a write is in progress go with the next one, at
    most `max_items` at a time. If a write fails, its items are written one by
    one, so a bad item fails only its own sender (with the error it caused).
    """

    def __init__(
        self, name: str, write_many: Callable[[list], list], gather_seconds: float, max_items: int = 200
    ) -> None:
        self.name = name
        self._write_many = write_many
        self.gather_seconds = gather_seconds
        self.max_items = max_items
        self._waiting: list[tuple[Any, asyncio.Future]] = []
        self._task: asyncio.Task | None = None

    async def submit(self, item) -> Any:
        """Write `item` with others; return its result once committed, or raise what writing it raised."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.append((item, future))
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._write_while_waiting(), name=f"{self.name}-writes")
        return await future

    async def _write_while_waiting(self) -> None:
        await asyncio.sleep(self.gather_seconds)
        while self._waiting:
            batch, self._waiting = self._waiting[: self.max_items], self._waiting[self.max_items :]
            batch = [(item, future) for item, future in batch if not future.done()]  # senders gone
            if batch:
                await self._write(batch)

    async def _write(self, batch: list[tuple[Any, asyncio.Future]]) -> None:
        write = database_sync_to_async(self._write_many)
        try:
            results = await write([item for item, _ in batch])
        except Exception as exc:
            if len(batch) == 1:
                _settle(batch[0][1], exception=exc)
                return
            log.warning("could not write %d %s together (%s); writing them one by one", len(batch), self.name, exc)
            for one in batch:
                await self._write([one])
            return
        for (_, future), result in zip(batch, results, strict=True):
            _settle(future, result)


def _settle(future: asyncio.Future, result=None, exception: BaseException | None = None) -> None:
    if future.done():  # its sender went away (the stream closed) while it was written
        return
    if exception is not None:
        future.set_exception(exception)
    else:
        future.set_result(result)


# One of each per process: every agent stream this process holds adds to them.
seen_nodes = Batch("node heartbeats", mark_nodes_seen, lambda: settings.LLMGW_LAST_SEEN_FLUSH_SECONDS)
acks = Batch("acks", lambda items, _: acknowledge_many(items), lambda: ACK_FLUSH_SECONDS)
# 10 ms of company for a hello: next to a connect's handshake and the agent's wait for its first heartbeat, nothing.
hellos = GroupCommit("hellos", on_hellos, gather_seconds=0.01)
shard_statuses = Batch(
    "shard reports", lambda items, _: record_shard_statuses(items), lambda: SHARD_STATUS_FLUSH_SECONDS, distinct=False
)
