"""API-key checks for the router, cached in memory so the hot path does no I/O.

A key is looked up in the database (through the ORM, off the event loop) only
on a cache miss. Valid keys are remembered for `positive_ttl` seconds, so a
revoked key keeps working at most that long; unknown keys are remembered for
`negative_ttl` seconds, so a client retrying a wrong key cannot hammer the
database. Concurrent misses for the same key share one lookup.

When the key store cannot be asked (the database is down, restarting or not
answering within `lookup_timeout`), a key keeps the last answer the store gave
for it, however old: a verified key keeps working and a refused one stays
refused, and revocations apply again at the first lookup that succeeds. A key
the store never answered for cannot be verified: `KeyStoreUnreachable`, which
the app answers with a 503. After a failed lookup the store is left alone for
`retry_seconds`, so an outage costs one failed attempt per interval rather
than one per request. A lookup that finds its kept connection dropped by the
server (a PostgreSQL restart) reconnects once, so the first lookup after a
restart succeeds.

Lookups run on one thread the cache owns, so its database connection has one
owner that `close()` can shut at router shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import sync_to_async
from django.db import DEFAULT_DB_ALIAS, Error, InterfaceError, OperationalError, close_old_connections, connections

from hub.credentials import hash_secret

from .models import ApiKey

log = logging.getLogger(__name__)

# sha256 of a key -> whether an active ApiKey has it; runs on the cache's thread, raises django.db.Error
# when the store cannot be asked.
KeyLookup = Callable[[str], bool]


class KeyStoreUnreachable(Exception):
    """The key store could not be asked, and it never answered for this key."""


def key_is_active(digest: str, using: str = DEFAULT_DB_ALIAS) -> bool:
    """Whether an active ApiKey has this hash, asked of database `using`; reconnects once if its connection died."""
    # This runs outside Django's request cycle, so retire connections the way a request would.
    close_old_connections()
    connection = connections[using]
    reused = connection.connection is not None
    try:
        return ApiKey.objects.using(using).active().filter(key_hash=digest).exists()
    except (OperationalError, InterfaceError):
        if not reused:
            raise
        # A kept connection the server dropped (restart, idle timeout) fails at its first use; a new one may not.
        with contextlib.suppress(Error):
            connection.close()
        return ApiKey.objects.using(using).active().filter(key_hash=digest).exists()


class ApiKeyCache:
    """Answers "is this bearer key valid?" from memory, asking the database only on a miss."""

    def __init__(
        self,
        positive_ttl: float = 30.0,
        negative_ttl: float = 5.0,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        *,
        lookup: KeyLookup = key_is_active,
        retry_seconds: float = 1.0,
        lookup_timeout: float = 3.0,
    ) -> None:
        self.positive_ttl = positive_ttl
        self.negative_ttl = negative_ttl
        self.max_entries = max_entries
        self.retry_seconds = retry_seconds
        self.lookup_timeout = lookup_timeout
        self._clock = clock
        self._lookup = lookup
        self._entries: dict[str, tuple[bool, float]] = {}  # sha256 of key -> (valid, expires at)
        self._pending: dict[str, asyncio.Future[bool]] = {}
        self._executor: ThreadPoolExecutor | None = None
        # Until then the store is not asked (it just failed, or a lookup is stuck): answers come from memory.
        self._unreachable_until = 0.0
        self.lookups = 0  # database lookups made, for tests and /health

    async def is_valid(self, key: str) -> bool:
        """Whether `key` belongs to an active ApiKey.

        Raises KeyStoreUnreachable if the database cannot be asked and never answered for `key`.
        """
        digest = hash_secret(key)
        cached = self._entries.get(digest)
        if cached is not None and cached[1] > self._clock():
            return cached[0]
        return await self._ask_store(digest, cached)

    async def _ask_store(self, digest: str, cached: tuple[bool, float] | None) -> bool:
        if self._clock() < self._unreachable_until:
            return _last_answer(cached)
        pending = self._pending.get(digest)
        if pending is None:
            pending = asyncio.ensure_future(self._fetch(digest))
            self._pending[digest] = pending
            pending.add_done_callback(lambda done: self._lookup_done(digest, done))
        try:
            async with asyncio.timeout(self.lookup_timeout):
                # Shielded: one waiter going away must not cancel the lookup the others share.
                return await asyncio.shield(pending)
        except KeyStoreUnreachable:
            return _last_answer(cached)
        except TimeoutError:
            if pending.done():
                raise
            # Stuck (an unanswered connect): leave the store alone until that lookup ends either way.
            self._unreachable_until = math.inf
            log.warning("the key store has not answered in %g s; answering API keys from memory", self.lookup_timeout)
            return _last_answer(cached)

    async def _fetch(self, digest: str) -> bool:
        self.lookups += 1
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-api-keys")
        try:
            valid = await sync_to_async(self._lookup, thread_sensitive=False, executor=self._executor)(digest)
        except Error as exc:
            if self._unreachable_until == 0.0:
                log.warning("the key store is unreachable, answering API keys from memory: %s", exc)
            self._unreachable_until = self._clock() + self.retry_seconds
            raise KeyStoreUnreachable(str(exc)) from exc
        if self._unreachable_until != 0.0:
            log.info("the key store answers again")
            self._unreachable_until = 0.0
        if len(self._entries) >= self.max_entries:
            self._prune()
        ttl = self.positive_ttl if valid else self.negative_ttl
        self._entries[digest] = (valid, self._clock() + ttl)
        return valid

    def _lookup_done(self, digest: str, done: asyncio.Future[bool]) -> None:
        self._pending.pop(digest, None)
        if not done.cancelled():
            done.exception()  # retrieved: every waiter may have given up on it already

    def _prune(self) -> None:
        now = self._clock()
        # Expired answers go, except verified keys: they are what keeps clients working through an outage.
        self._entries = {d: entry for d, entry in self._entries.items() if entry[0] or entry[1] > now}
        if len(self._entries) >= self.max_entries:
            # A flood of distinct wrong keys: forget every refusal rather than grow without bound.
            self._entries = {d: entry for d, entry in self._entries.items() if entry[0]}
        if len(self._entries) >= self.max_entries:
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


def _last_answer(cached: tuple[bool, float] | None) -> bool:
    """The store's last answer for a key it cannot be asked about now, however old."""
    if cached is None:
        raise KeyStoreUnreachable("cannot verify the API key: the key store is unreachable")
    return cached[0]
