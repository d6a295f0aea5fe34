"""Router-only mode's own storing of token usage, since no control plane's tick is there to do it.

Every `interval` seconds (and once more at shutdown, after the last usage
flush) the router takes the token counts and keys' last use from its hub
(`take_tokens`: read and reset in one step, so of several routers sharing one
Redis each count is stored by exactly one) and adds them to the database
(`keys.usage.store_tokens`, which adds in SQL: concurrent stores add up), and the
counts of answers whose engine broke off likewise (`take_continuations`,
`keys.usage.store_continuations`). When the database refuses, the counts go back to the hub for the next round. It
also forgets routers' marks lapsed past LLMGW_ROUTER_FORGET_SECONDS, as the
tick does in a fleet: the rate limits' shares count the marks, and a killed
router's would shrink every other router's share for good.

The ORM and the synchronous hub calls run on one thread of its own, never on
the event loop; that thread keeps its database connection, closed at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings
from django.db import close_old_connections, connections

from hub.contracts import TokenSource
from keys.records import record_requests
from keys.usage import store_continuations, store_tokens
from router.background import raise_if_cancelling

log = logging.getLogger(__name__)

# How often token counts move from the hub to the database: what a killed process can lose at most.
STORE_SECONDS = 5.0


class TokenStore:
    """Moves token counts from the hub to `TokenUsage` every `interval` seconds; a background task of the app."""

    def __init__(
        self,
        hub: TokenSource,
        interval: float = STORE_SECONDS,
        *,
        forget_seconds: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, not {interval!r}")
        self.hub = hub
        self.interval = interval
        self.forget_seconds = settings.LLMGW_ROUTER_FORGET_SECONDS if forget_seconds is None else forget_seconds
        self._clock = clock
        self._executor: ThreadPoolExecutor | None = None
        self._failing = False  # said once while the hub stays unreachable, not every round

    async def run(self) -> None:
        """Store every `interval` seconds, until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            await self.store()
            raise_if_cancelling()

    async def store(self) -> int:
        """Take the hub's counts and store them, on the store's thread; the number of rows added to."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-token-store")
        try:
            stored = await asyncio.get_running_loop().run_in_executor(self._executor, self._store)
        except Exception as exc:  # the hub unreachable: the counts wait there for the next round
            if not self._failing:
                log.warning("could not take token usage from the hub, will retry: %s", exc)
                self._failing = True
            return 0
        if self._failing:
            log.info("taking token usage from the hub again")
            self._failing = False
        return stored

    async def close(self) -> None:
        """Store what the last usage flush handed the hub, then close the thread's database connection."""
        await self.store()
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.get_running_loop().run_in_executor(executor, connections.close_all)
            executor.shutdown(wait=False)

    def _store(self) -> int:
        # Outside Django's request cycle: retire connections the way a request would.
        close_old_connections()
        self._forget_gone_routers()
        self._store_continuations()
        record_requests(self.hub)  # the per-request log, when it is kept
        tokens, keys = self.hub.take_tokens()
        if not (tokens or keys):
            return 0
        try:
            return store_tokens(tokens, keys)
        except Exception as exc:
            log.warning("could not store token usage, giving it back to the hub for the next round: %s", exc)
            try:
                self.hub.restore_tokens(tokens, keys)
            except Exception as again:
                log.error("token usage lost: the database refused it and the hub could not take it back: %s", again)
            return 0

    def _store_continuations(self) -> None:
        continuations = self.hub.take_continuations()
        if not continuations:
            return
        try:
            store_continuations(continuations)
        except Exception as exc:
            log.warning("could not store continuation counts, giving them back to the hub for the next round: %s", exc)
            try:
                self.hub.restore_continuations(continuations)
            except Exception as again:
                log.error(
                    "continuation counts lost: the database refused them and the hub could not take them back: %s",
                    again,
                )

    def _forget_gone_routers(self) -> None:
        now = self._clock()
        gone = [mark.router for mark in self.hub.router_marks() if now - mark.renewed > self.forget_seconds]
        if gone:
            log.info("forgetting routers silent for over %g s: %s", self.forget_seconds, ", ".join(sorted(gone)))
            self.hub.forget_routers(gone)
