"""API-key checks for the router, cached in memory so the hot path does no I/O.

A key is looked up in the database (through the ORM, off the event loop) only
on a cache miss. Valid keys are remembered for `positive_ttl` seconds, so a
revoked key keeps working at most that long; unknown keys are remembered for
`negative_ttl` seconds, so a client retrying a wrong key cannot hammer the
database. Concurrent misses for the same key share one lookup.

Lookups run on one thread the cache owns, so its database connection has one
owner that `close()` can shut at router shutdown.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import sync_to_async
from django.db import close_old_connections, connections

from hub.credentials import hash_secret

from .models import ApiKey


def _key_is_active(digest: str) -> bool:
    # This runs outside Django's request cycle, so retire connections the way a request would.
    close_old_connections()
    return ApiKey.objects.active().filter(key_hash=digest).exists()


class ApiKeyCache:
    """Answers "is this bearer key valid?" from memory, asking the database only on a miss."""

    def __init__(
        self, positive_ttl: float = 30.0, negative_ttl: float = 5.0, max_entries: int = 10_000, clock=time.monotonic
    ):
        self.positive_ttl = positive_ttl
        self.negative_ttl = negative_ttl
        self.max_entries = max_entries
        self._clock = clock
        self._entries: dict[str, tuple[bool, float]] = {}  # sha256 of key -> (valid, expires at)
        self._pending: dict[str, asyncio.Future] = {}
        self._executor: ThreadPoolExecutor | None = None
        self.lookups = 0  # database lookups made, for tests and /health

    async def is_valid(self, key: str) -> bool:
        """Whether `key` belongs to an active ApiKey. Raises if the database cannot be asked."""
        digest = hash_secret(key)
        cached = self._entries.get(digest)
        if cached is not None and cached[1] > self._clock():
            return cached[0]
        pending = self._pending.get(digest)
        if pending is None:
            pending = asyncio.ensure_future(self._fetch(digest))
            self._pending[digest] = pending
            pending.add_done_callback(lambda _f: self._pending.pop(digest, None))
        # Shielded: one waiter going away must not cancel the lookup the others share.
        return await asyncio.shield(pending)

    async def _fetch(self, digest: str) -> bool:
        self.lookups += 1
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-api-keys")
        valid = await sync_to_async(_key_is_active, thread_sensitive=False, executor=self._executor)(digest)
        if len(self._entries) >= self.max_entries:
            self._prune()
        ttl = self.positive_ttl if valid else self.negative_ttl
        self._entries[digest] = (valid, self._clock() + ttl)
        return valid

    def _prune(self) -> None:
        now = self._clock()
        self._entries = {d: entry for d, entry in self._entries.items() if entry[1] > now}
        if len(self._entries) >= self.max_entries:
            # Still full of live entries (a flood of distinct keys): start over rather than grow without bound.
            self._entries.clear()

    async def close(self) -> None:
        """Close the lookup thread's database connection and stop the thread (it restarts on demand)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.get_running_loop().run_in_executor(executor, connections.close_all)
            executor.shutdown(wait=False)

    def forget(self) -> None:
        """Drop every cached answer (e.g. after revoking keys, in tests)."""
        self._entries.clear()
