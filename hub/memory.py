"""The embedded hub: endpoint table, usage stamps, watch mark and activations in this process.

Shared by the embedded ticker's thread and the router's event loop, so every
method takes one lock and none blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable

from .contracts import EndpointTable
from .fingerprint import fingerprint


class InProcessHub:
    """Embedded backends: everything in memory. `clock` (Unix seconds) is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._lock = threading.Lock()
        self._table: EndpointTable | None = None
        self._stamps: dict[str, float] = {}
        self._activations: set[str] = set()
        self._watchers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[EndpointTable]]] = []
        # (since, last renewed, ttl) of the routers' "watching" mark; None until a router flushes.
        self._watch: tuple[float, float, float] | None = None
        self._activation_listeners: list[Callable[[], None]] = []

    def on_activation(self, listener: Callable[[], None]) -> None:
        """Call `listener` (from any thread) whenever a router asks for an activation.

        The embedded runner uses it to tick at once instead of at the next interval.
        """
        with self._lock:
            self._activation_listeners.append(listener)

    # -- control plane side -------------------------------------------------
    def publish_endpoints(self, table: EndpointTable) -> bool:
        table = {**table, "fingerprint": fingerprint(table)}
        with self._lock:
            if self._table is not None and self._table["fingerprint"] == table["fingerprint"]:
                return False
            self._table = table
            watchers = list(self._watchers)
        for loop, queue in watchers:
            with contextlib.suppress(RuntimeError):  # that router's loop has closed
                loop.call_soon_threadsafe(queue.put_nowait, table)
        return True

    def collect_usage(self) -> dict[str, float]:
        with self._lock:
            return dict(self._stamps)

    def forget_usage(self, replica_ids: Iterable[str | int]) -> None:
        with self._lock:
            for rid in replica_ids:
                self._stamps.pop(str(rid), None)

    def drain_activations(self) -> set[str]:
        with self._lock:
            wanted, self._activations = self._activations, set()
        return wanted

    def watching_since(self) -> float | None:
        with self._lock:
            if self._watch is None:
                return None
            since, renewed, ttl = self._watch
            return since if self._clock() - renewed <= ttl else None

    # -- router side ----------------------------------------------------------
    async def read_endpoints(self) -> EndpointTable | None:
        with self._lock:
            return self._table

    async def watch_endpoints(self) -> AsyncIterator[EndpointTable]:
        queue: asyncio.Queue[EndpointTable] = asyncio.Queue()
        entry = (asyncio.get_running_loop(), queue)
        with self._lock:
            self._watchers.append(entry)
        try:
            while True:
                yield await queue.get()
        finally:
            with self._lock:
                self._watchers.remove(entry)

    async def record_usage(self, stamps: dict[str, float]) -> None:
        with self._lock:
            for rid, ts in stamps.items():
                if ts > self._stamps.get(rid, float("-inf")):
                    self._stamps[rid] = ts

    async def request_activation(self, model_name: str) -> None:
        with self._lock:
            self._activations.add(model_name)
            listeners = list(self._activation_listeners)
        for listener in listeners:
            listener()

    async def keep_watching(self, ttl: float) -> None:
        now = self._clock()
        with self._lock:
            lapsed = self._watch is None or now - self._watch[1] > self._watch[2]
            since = now if lapsed or self._watch is None else self._watch[0]
            self._watch = (since, now, ttl)
