"""API-key checks for the router, cached in memory so the hot path does no I/O.

A key is looked up in the database (through the ORM, off the event loop) only
on a cache miss; the cache answers with a frozen `KeyInfo` (its scopes and
expiry), so checking a request against the key's models, pools and expiry is
in-memory work. Valid keys are remembered for `positive_ttl` seconds;
unknown keys for `negative_ttl` seconds, so a client retrying a wrong key
cannot hammer the database. Concurrent misses for the same key share one
lookup. A change to a key (revoked, deleted, scopes edited) is pushed through
the hub (`follow`): its entry is dropped at once, so every router applies it
within a second; the positive TTL is only the backstop for a lost push.

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
import enum
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from asgiref.sync import sync_to_async
from django.db import DEFAULT_DB_ALIAS, Error, InterfaceError, OperationalError, close_old_connections, connections
from django.db.models import Q

from hub.budgets import Window
from hub.credentials import hash_secret
from hub.priority import RANKS, STANDARD, PriorityClass
from keys.models import ApiKey, Budget
from router.accounting.budgets import BudgetRule
from router.background import raise_if_cancelling

log = logging.getLogger(__name__)


class NotCached(enum.Enum):
    """The type of NOT_CACHED: the cache has no answer for a key (never looked up, or its answer expired)."""

    NOT_CACHED = "not cached"


NOT_CACHED = NotCached.NOT_CACHED


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """What the router knows of one active API key: who it is, what it may use, and until when."""

    id: int
    name: str
    digest: str
    """sha256 of the key, as stored."""
    allowed_models: frozenset[str] = frozenset()
    """Model names or aliases it may use; empty = every model."""
    team_models: frozenset[str] = frozenset()
    """Those its team may use (teams.Team): a request must fit both scopes; empty = every model."""
    allowed_pools: frozenset[str] = frozenset()
    """Pools whose replicas may serve it; empty = any pool."""
    expires_at: float | None = None
    """Unix time from which it is refused; None = never."""
    rpm: int | None = None
    tpm: int | None = None
    team_id: int | None = None
    user_id: int | None = None
    budgets: tuple[BudgetRule, ...] = ()
    """The budgets a request of it must fit (router.accounting.budgets): its own, its holder's in its team, its
    team's; empty = none."""
    tenant: str = ""
    """Whose share of a full model its requests take (router.picking.admission): its team's name, else
    `key:<id>` (a key of no team is a tenant of its own)."""
    priority: int = STANDARD
    """Its priority class's rank (hub.priority: 0 interactive, 1 standard, 2 batch): its own, else its team's."""
    weight: int = 1
    """Its tenant's weight in a full model's fair queue (its team's; 1 for a key of no team)."""

    def allows(self, public: str, resolve: Callable[[str], str | None]) -> bool:
        """Whether it may use the model whose public name is `public`: its own scope and its team's allow it;
        scope entries resolve through `resolve`.

        A name in a scope allows its aliases, and an alias allows its model: both sides are
        compared as public names in the catalog the router has now.
        """
        return _in_scope(self.allowed_models, public, resolve) and _in_scope(self.team_models, public, resolve)

    def team_allows(self, public: str, resolve: Callable[[str], str | None]) -> bool:
        """Whether its team's scope allows the model (so a refusal is the key's own)."""
        return _in_scope(self.team_models, public, resolve)


def _in_scope(scope: frozenset[str], public: str, resolve: Callable[[str], str | None]) -> bool:
    if not scope or public in scope:
        return True
    return any(resolve(entry) == public for entry in scope)


# sha256 of a key -> its KeyInfo if an active ApiKey has it, else None; runs on the cache's thread,
# raises django.db.Error when the store cannot be asked.
KeyLookup = Callable[[str], KeyInfo | None]


class KeyChangeSource(Protocol):
    """Where the router hears which keys changed (hub.contracts.KeyChangeSource)."""

    def watch_key_changes(self) -> AsyncIterator[list[str]]: ...


class KeyStoreUnreachable(Exception):
    """The key store could not be asked, and it never answered for this key."""


def key_info(api_key: ApiKey, budgets: tuple[BudgetRule, ...] = ()) -> KeyInfo:
    """The router's view of an ApiKey row (and the budgets that apply to it)."""
    team = api_key.team
    return KeyInfo(
        id=api_key.pk,
        name=api_key.name,
        digest=api_key.key_hash,
        allowed_models=frozenset(api_key.allowed_models or ()),
        team_models=frozenset(api_key.team.allowed_models or ()) if api_key.team is not None else frozenset(),
        allowed_pools=frozenset(api_key.allowed_pools or ()),
        expires_at=None if api_key.expires_at is None else api_key.expires_at.timestamp(),
        rpm=api_key.rpm,
        tpm=api_key.tpm,
        team_id=api_key.team_id,
        user_id=api_key.user_id,
        budgets=budgets,
        tenant=f"key:{api_key.pk}" if team is None else team.name,
        priority=RANKS[api_key.priority_class or (PriorityClass.STANDARD if team is None else team.priority_class)],
        weight=1 if team is None else team.weight,
    )


def budgets_of(api_key: ApiKey, using: str = DEFAULT_DB_ALIAS) -> tuple[BudgetRule, ...]:
    """The budgets that apply to a key: its own, its holder's within its team, its team's (in that order, the
    order a refusal names them in); one query."""
    scope = Q(key_id=api_key.pk)
    if api_key.team_id is not None:
        scope |= Q(team_id=api_key.team_id, user__isnull=True)
        if api_key.user_id is not None:
            scope |= Q(team_id=api_key.team_id, user_id=api_key.user_id)
    team = api_key.team.name if api_key.team is not None else ""
    rules = []
    for budget in Budget.objects.using(using).filter(scope).select_related("user").order_by("id"):
        if budget.key_id is not None:
            rank, words = 0, f"key “{api_key.name}”"
        elif budget.user is not None:
            rank, words = 1, f"{budget.user.get_username()} in team “{team}”"
        else:
            rank, words = 2, f"team “{team}”"
        limit = int(budget.amount.scaleb(12))
        rules.append((rank, BudgetRule(budget.pk, limit, Window(budget.window), budget.timezone, words)))
    return tuple(rule for _, rule in sorted(rules, key=lambda pair: pair[0]))


def find_active_key(digest: str, using: str = DEFAULT_DB_ALIAS) -> KeyInfo | None:
    """The active ApiKey with this hash, asked of database `using`; reconnects once if its connection died."""

    def ask() -> KeyInfo | None:
        row = ApiKey.objects.using(using).active().select_related("team").filter(key_hash=digest).first()
        return None if row is None else key_info(row, budgets_of(row, using))

    # This runs outside Django's request cycle, so retire connections the way a request would.
    close_old_connections()
    connection = connections[using]
    reused = connection.connection is not None
    try:
        return ask()
    except (OperationalError, InterfaceError):
        if not reused:
            raise
        # A kept connection the server dropped (restart, idle timeout) fails at its first use; a new one may not.
        with contextlib.suppress(Error):
            connection.close()
        return ask()


class ApiKeyCache:
    """Answers "which key is this bearer token, if any?" from memory, asking the database only on a miss."""

    def __init__(
        self,
        positive_ttl: float = 30.0,
        negative_ttl: float = 5.0,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        *,
        lookup: KeyLookup = find_active_key,
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
        self._entries: dict[str, tuple[KeyInfo | None, float]] = {}  # sha256 of key -> (key or None, expires at)
        self._pending: dict[str, asyncio.Future[KeyInfo | None]] = {}
        # Bearer token -> its digest, so a known token is not hashed again on every request (bounded like
        # the entries; a flood of made-up tokens only empties it).
        self._digests: dict[str, str] = {}
        # Digests changed while a lookup for them was running: that lookup may have read the old row.
        self._changed_during_lookup: set[str] = set()
        self._executor: ThreadPoolExecutor | None = None
        # Until then the store is not asked (it just failed, or a lookup is stuck): answers come from memory.
        self._unreachable_until = 0.0
        self.lookups = 0  # database lookups made, for tests and /health
        self.changes_heard = 0  # key changes applied from the hub, for tests and /health

    def cached(self, key: str) -> KeyInfo | None | NotCached:
        """What the cache answers for `key` without asking the store (an active key, or None: unknown or
        revoked), or NOT_CACHED: then `check` asks the store. No coroutine: the hot path of every request."""
        digest = self._digests.get(key)
        if digest is None:
            return NOT_CACHED
        cached = self._entries.get(digest)
        if cached is not None and cached[1] > self._clock():
            return cached[0]
        return NOT_CACHED

    async def check(self, key: str) -> KeyInfo | None:
        """The active key `key` is, or None if it is unknown or revoked.

        Raises KeyStoreUnreachable if the database cannot be asked and never answered for `key`.
        """
        info = self.cached(key)
        if info is not NOT_CACHED:
            return info
        digest = self._digests.get(key)
        if digest is None:
            if len(self._digests) >= self.max_entries:
                self._digests.clear()
            digest = self._digests[key] = hash_secret(key)
        return await self._ask_store(digest, self._entries.get(digest))

    async def _ask_store(self, digest: str, cached: tuple[KeyInfo | None, float] | None) -> KeyInfo | None:
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

    async def _fetch(self, digest: str) -> KeyInfo | None:
        self.lookups += 1
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-api-keys")
        try:
            info = await sync_to_async(self._lookup, thread_sensitive=False, executor=self._executor)(digest)
        except Error as exc:
            if self._unreachable_until == 0.0:
                log.warning("the key store is unreachable, answering API keys from memory: %s", exc)
            self._unreachable_until = self._clock() + self.retry_seconds
            raise KeyStoreUnreachable(str(exc)) from exc
        if self._unreachable_until != 0.0:
            log.info("the key store answers again")
            self._unreachable_until = 0.0
        if digest in self._changed_during_lookup:
            # The row may have changed after this lookup read it: answer this once, remember nothing.
            self._changed_during_lookup.discard(digest)
            return info
        if len(self._entries) >= self.max_entries:
            self._prune()
        ttl = self.positive_ttl if info is not None else self.negative_ttl
        self._entries[digest] = (info, self._clock() + ttl)
        return info

    def _lookup_done(self, digest: str, done: asyncio.Future[KeyInfo | None]) -> None:
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

    def forget_digests(self, digests: list[str]) -> None:
        """These keys changed (revoked, deleted, edited): the next request with one reads its row again."""
        entries, pending = self._entries, self._pending
        for digest in digests:
            entries.pop(digest, None)
            if digest in pending:
                self._changed_during_lookup.add(digest)
        self.changes_heard += len(digests)

    async def follow(self, source: KeyChangeSource, retry_seconds: float = 1.0) -> None:
        """Drop each key the hub says changed, forever; a push lost meanwhile is covered by the positive TTL."""
        while True:
            try:
                async for digests in source.watch_key_changes():
                    self.forget_digests(digests)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                raise_if_cancelling()
                log.warning("key-change watch failed, retrying in %g s: %s", retry_seconds, exc)
            await asyncio.sleep(retry_seconds)

    async def close(self) -> None:
        """Close the lookup thread's database connection and stop the thread (it restarts on demand)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.get_running_loop().run_in_executor(executor, connections.close_all)
            executor.shutdown(wait=False)


def _last_answer(cached: tuple[KeyInfo | None, float] | None) -> KeyInfo | None:
    """The store's last answer for a key it cannot be asked about now, however old."""
    if cached is None:
        raise KeyStoreUnreachable("cannot verify the API key: the key store is unreachable")
    return cached[0]
