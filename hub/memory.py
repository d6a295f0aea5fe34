"""The embedded hub: endpoint table, usage stamps, token and continuation counts, routers' watch marks,
activations, key changes and budgets' counters in this process.

Shared by the embedded ticker's thread and the router's event loop, so every
method takes one lock and none blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable

from hub.budgets import InProcessBudgets, Refusal, Reservation
from hub.contracts import (
    Activation,
    ContinuationCounts,
    EndpointTable,
    LimitCount,
    LimitCounts,
    ReplicaTokens,
    RequestRecord,
    RouterMark,
    TokenCount,
    TokenCounts,
    UsageReport,
    UsageSnapshot,
    add_continuation_counts,
    add_replica_tokens,
    add_token_counts,
    checked,
    hour_of,
)
from hub.fingerprint import fingerprinted

MAX_RECORDS = 1_000_000  # per-request records held until taken


class InProcessHub:
    """Embedded backends: everything in memory. `clock` (Unix seconds) is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._table: EndpointTable | None = None
        self._encoded: bytes | None = None  # `_table` as routers read it
        self._stamps: dict[str, float] = {}
        self._activations: set[Activation] = set()
        self._watchers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[bytes]]] = []
        self._key_watchers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[list[str]]]] = []
        self._marks: dict[str, RouterMark] = {}  # router id -> its watch mark
        self._activation_listeners: list[Callable[[], None]] = []
        self._tokens: dict[int, TokenCounts] = {}  # hour -> counts added up until the tick takes them
        self._keys: dict[str, float] = {}  # key digest -> last use, until the tick takes it
        self._continuations: dict[int, ContinuationCounts] = {}  # hour -> counts, like `_tokens`
        self._replica_tokens: dict[int, ReplicaTokens] = {}  # hour -> tokens per replica and key, like `_tokens`
        self._limits: dict[tuple[int, str], list[int]] = {}  # (minute, key digest) -> [requests, tokens]
        self._records: list[RequestRecord] = []  # per-request records, until the tick takes them
        # Budgets' counters; a settlement's cost (or an expired reservation's) is added to `_tokens`.
        self.budgets = InProcessBudgets(charge=self._charge, wall=clock)

    def on_activation(self, listener: Callable[[], None]) -> None:
        """Call `listener` (from any thread) whenever a router asks for an activation.

        The embedded runner uses it to tick at once instead of at the next interval.
        """
        with self._lock:
            self._activation_listeners.append(listener)

    # -- control plane side -------------------------------------------------
    def publish_endpoints(self, table: EndpointTable) -> bool:
        table, encoded = fingerprinted(table)
        with self._lock:
            if self._table is not None and self._table.fingerprint == table.fingerprint:
                return False
            self._table, self._encoded = table, encoded
            watchers = list(self._watchers)
        for loop, queue in watchers:
            with contextlib.suppress(RuntimeError):  # that router's loop has closed
                loop.call_soon_threadsafe(queue.put_nowait, encoded)
        return True

    def collect_usage(self) -> UsageSnapshot:
        self.budgets.sweep()  # expired reservations are charged before the ledger is taken
        with self._lock:
            tokens, self._tokens = self._tokens, {}
            keys, self._keys = self._keys, {}
            continuations, self._continuations = self._continuations, {}
            replica_tokens, self._replica_tokens = self._replica_tokens, {}
            return UsageSnapshot(
                stamps=dict(self._stamps),
                routers=list(self._marks.values()),
                tokens=tokens,
                keys=keys,
                continuations=continuations,
                replica_tokens=replica_tokens,
            )

    def take_tokens(self) -> tuple[dict[int, TokenCounts], dict[str, float]]:
        self.budgets.sweep()
        with self._lock:
            tokens, self._tokens = self._tokens, {}
            keys, self._keys = self._keys, {}
            self._replica_tokens = {}  # router-only mode: no replicas of a control plane's, no showback
        return tokens, keys

    def take_continuations(self) -> dict[int, ContinuationCounts]:
        with self._lock:
            continuations, self._continuations = self._continuations, {}
        return continuations

    def router_marks(self) -> list[RouterMark]:
        with self._lock:
            return list(self._marks.values())

    def restore_tokens(
        self, tokens: dict[int, TokenCounts], keys: dict[str, float], replicas: dict[int, ReplicaTokens] | None = None
    ) -> None:
        with self._lock:
            for hour, counts in tokens.items():
                self._add_tokens(hour, counts)
            for hour, per_replica in (replicas or {}).items():
                add_replica_tokens(self._replica_tokens.setdefault(hour, {}), per_replica)
            self._add_keys(keys)

    def restore_continuations(self, continuations: dict[int, ContinuationCounts]) -> None:
        with self._lock:
            for hour, counts in continuations.items():
                add_continuation_counts(self._continuations.setdefault(hour, {}), counts)

    def take_records(self) -> list[RequestRecord]:
        with self._lock:
            records, self._records = self._records, []
        return records

    def restore_records(self, records: list[RequestRecord]) -> None:
        with self._lock:
            self._records[:0] = records

    def _charge(self, hour: int, ledger: str, spend: int, requests: int) -> None:
        """Add a budget's charge to the ledger (called by `budgets`, under its lock: takes this hub's)."""
        digest, model = ledger.split(" ", 1)
        count = TokenCount(requests=requests, prompt=0, completion=0, spend=spend)
        with self._lock:
            self._add_tokens(hour, {digest: {model: count}})

    def budget_use(self, counters: list[str]) -> dict[str, int]:
        return {counter: self.budgets.used(counter) for counter in counters}

    async def reserve_budget(self, reservation: Reservation) -> Refusal | None:
        return self.budgets.reserve(reservation)

    async def settle_budget(self, reservation_id: str, cost: int, hour: int) -> bool:
        return self.budgets.settle(reservation_id, cost, hour)

    def _add_tokens(self, hour: int, counts: TokenCounts) -> None:
        add_token_counts(self._tokens.setdefault(hour, {}), counts)

    def _add_keys(self, keys: dict[str, float]) -> None:
        for digest, ts in keys.items():
            if ts > self._keys.get(digest, float("-inf")):
                self._keys[digest] = ts

    def forget_usage(self, replica_ids: Iterable[str | int]) -> None:
        with self._lock:
            for rid in replica_ids:
                self._stamps.pop(str(rid), None)

    def drain_activations(self) -> set[Activation]:
        with self._lock:
            wanted, self._activations = self._activations, set()
        return wanted

    def forget_routers(self, routers: Iterable[str]) -> None:
        with self._lock:
            for router in routers:
                self._marks.pop(router, None)

    # -- router side ----------------------------------------------------------
    async def read_endpoints(self) -> bytes | None:
        with self._lock:
            return self._encoded

    async def watch_endpoints(self) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        entry = (asyncio.get_running_loop(), queue)
        with self._lock:
            self._watchers.append(entry)
        try:
            while True:
                yield await queue.get()
        finally:
            with self._lock:
                self._watchers.remove(entry)

    async def report_usage(self, report: UsageReport) -> None:
        report = checked(report)
        now = self._clock()
        with self._lock:
            for rid, ts in report.stamps.items():
                if ts > self._stamps.get(rid, float("-inf")):
                    self._stamps[rid] = ts
            if report.tokens:
                self._add_tokens(hour_of(now), report.tokens)
            if report.replica_tokens:
                add_replica_tokens(self._replica_tokens.setdefault(hour_of(now), {}), report.replica_tokens)
            if report.continuations:
                add_continuation_counts(self._continuations.setdefault(hour_of(now), {}), report.continuations)
            if report.records:
                self._records.extend(report.records)
                del self._records[:-MAX_RECORDS]  # nobody takes them: the newest are kept
            self._add_keys(report.keys)
            previous = self._marks.get(report.router)
            # A lapse is a gap in what this router told us: its watch starts again now.
            since = previous.since if previous is not None and not previous.lapsed(now) else now
            self._marks[report.router] = RouterMark(
                router=report.router,
                since=since,
                renewed=now,
                ttl=report.ttl,
                in_flight=dict(report.in_flight),
                windows=dict(report.windows),
            )

    async def leave(self, router: str) -> None:
        with self._lock:
            self._marks.pop(router, None)

    async def request_activation(self, model_name: str, pools: Iterable[str] = ()) -> None:
        activation = Activation.of(model_name, pools)
        with self._lock:
            self._activations.add(activation)
            listeners = list(self._activation_listeners)
        for listener in listeners:
            listener()

    # -- key changes (control plane publishes from any thread; routers watch on their loop) --------------
    def publish_key_changes(self, digests: list[str]) -> None:
        batch = list(digests)
        with self._lock:
            watchers = list(self._key_watchers)
        for loop, queue in watchers:
            with contextlib.suppress(RuntimeError):  # that router's loop has closed
                loop.call_soon_threadsafe(queue.put_nowait, batch)

    async def watch_key_changes(self) -> AsyncIterator[list[str]]:
        queue: asyncio.Queue[list[str]] = asyncio.Queue()
        entry = (asyncio.get_running_loop(), queue)
        with self._lock:
            self._key_watchers.append(entry)
        try:
            while True:
                yield await queue.get()
        finally:
            with self._lock:
                self._key_watchers.remove(entry)

    async def sync_limits(self, minute: int, deltas: LimitCounts) -> tuple[LimitCounts, int]:
        with self._lock:
            # Older minutes limit nothing any more.
            for old in [k for k in self._limits if k[0] < minute]:
                del self._limits[old]
            totals: LimitCounts = {}
            for digest, (requests, tokens) in deltas.items():
                counts = self._limits.setdefault((minute, digest), [0, 0])
                counts[0] += requests
                counts[1] += tokens
                totals[digest] = LimitCount(counts[0], counts[1])
            return totals, max(1, len(self._marks))
