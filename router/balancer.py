"""The router's view of the endpoint table: name resolution, replica choice and last-use stamps.

Everything here is synchronous and cheap: it runs on the router's event loop
for every request. Choosing a replica and stamping its last use happen under
one lock in one short critical section (DESIGN invariant 4), so recording use
costs a dict write per request and nothing else.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Endpoint:
    """One ready replica of a model, as published by the control plane.

    `outstanding` counts requests this router has sent to it that have not
    finished; it survives table updates as long as the replica keeps its URL.
    """

    replica_id: str
    model: str
    url: str
    priority: int = 0
    weight: int = 1
    pool: str = "default"
    outstanding: int = field(default=0, compare=False)

    @property
    def load(self) -> float:
        return self.outstanding / self.weight


class TableError(ValueError):
    """An endpoint table that does not have the published shape."""


def _parse_endpoint(raw: object) -> Endpoint:
    if not isinstance(raw, dict):
        raise TableError(f"endpoint entry is not an object: {raw!r}")
    try:
        replica_id, model, url = str(raw["replica_id"]), raw["model"], raw["url"]
    except KeyError as exc:
        raise TableError(f"endpoint entry lacks {exc.args[0]!r}: {raw!r}") from None
    if not isinstance(model, str) or not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise TableError(f"endpoint entry has a bad model or url: {raw!r}")
    priority, weight = raw.get("priority", 0), raw.get("weight", 1)
    if not isinstance(priority, int) or not isinstance(weight, int) or weight < 1:
        raise TableError(f"endpoint entry has a bad priority or weight: {raw!r}")
    return Endpoint(replica_id, model, url.rstrip("/"), priority, weight, str(raw.get("pool", "default")))


class Balancer:
    """Resolves public names and aliases, picks a replica per request, and keeps last-use stamps."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._names: dict[str, str] = {}  # public name or alias -> public name
        self._catalog: dict[str, list[str]] = {}  # public name -> aliases
        self._unplaceable: dict[str, str] = {}  # public name -> why the control plane cannot place it now
        self._start_seconds: dict[str, float] = {}  # public name -> learned time from placement to ready
        self._endpoints: dict[str, list[Endpoint]] = {}  # public name -> ready replicas
        self._by_replica: dict[str, Endpoint] = {}
        self._turn: dict[str, int] = {}  # round-robin position per model, for ties
        self._stamps: dict[str, float] = {}  # replica id -> last use (time.time()), not yet flushed
        self.fingerprint: str | None = None

    # -- the table --------------------------------------------------------------
    def apply_table(self, table: dict[str, Any]) -> bool:
        """Install a published table; return False when it is the one already installed.

        Malformed entries are logged and skipped rather than failing the whole
        table: one bad row must not take every model offline.
        """
        if not isinstance(table, dict):
            raise TableError(f"endpoint table is not an object: {type(table).__name__}")
        fingerprint = table.get("fingerprint")
        if fingerprint is not None and fingerprint == self.fingerprint:
            return False
        models = table.get("models") or {}
        if not isinstance(models, dict):
            raise TableError("endpoint table 'models' is not an object")
        names: dict[str, str] = {}
        catalog: dict[str, list[str]] = {}
        unplaceable: dict[str, str] = {}
        start_seconds: dict[str, float] = {}
        for public, entry in models.items():
            aliases = entry.get("aliases", []) if isinstance(entry, dict) else []
            aliases = [a for a in aliases if isinstance(a, str)]
            catalog[public] = aliases
            reason = entry.get("unplaceable") if isinstance(entry, dict) else None
            if isinstance(reason, str) and reason:
                unplaceable[public] = reason
            start = entry.get("start_seconds") if isinstance(entry, dict) else None
            if isinstance(start, int | float) and not isinstance(start, bool) and start >= 0:
                start_seconds[public] = float(start)
            names[public] = public
            for alias in aliases:
                names.setdefault(alias, public)  # a public name always wins over a clashing alias

        endpoints: dict[str, list[Endpoint]] = {}
        by_replica: dict[str, Endpoint] = {}
        with self._lock:
            for raw in table.get("endpoints") or []:
                try:
                    fresh = _parse_endpoint(raw)
                except TableError as exc:
                    log.warning("skipping endpoint: %s", exc)
                    continue
                if fresh.model not in catalog:
                    continue
                current = self._by_replica.get(fresh.replica_id)
                if current is not None and current.url == fresh.url and current.model == fresh.model:
                    # Keep the same object so requests in flight still count against it.
                    current.priority, current.weight, current.pool = fresh.priority, fresh.weight, fresh.pool
                    fresh = current
                by_replica[fresh.replica_id] = fresh
                endpoints.setdefault(fresh.model, []).append(fresh)
            self._names, self._catalog, self._unplaceable = names, catalog, unplaceable
            self._start_seconds = start_seconds
            self._endpoints, self._by_replica = endpoints, by_replica
            self.fingerprint = fingerprint
        return True

    def resolve(self, name: str) -> str | None:
        """The public name `name` refers to (itself or the model it is an alias of), or None."""
        return self._names.get(name)

    def unplaceable(self, model: str) -> str | None:
        """Why the control plane could not place `model` at its last attempt, or None."""
        return self._unplaceable.get(model)

    def start_seconds(self, model: str) -> float | None:
        """How long `model` has taken to start (learned by the control plane), or None if unknown."""
        return self._start_seconds.get(model)

    def catalog(self) -> dict[str, list[str]]:
        """Public model name -> aliases, as last published."""
        return self._catalog

    def endpoints(self, model: str | None = None) -> list[Endpoint]:
        if model is not None:
            return list(self._endpoints.get(model, ()))
        return list(self._by_replica.values())

    # -- per request ------------------------------------------------------------
    def pick(self, model: str, exclude: Iterable[str] = ()) -> Endpoint | None:
        """Choose a replica of `model` and count a request against it; None if it has none.

        Highest priority first, then least outstanding requests per unit of
        weight, ties taken in turn. The choice and the last-use stamp are one
        critical section, so a stamp always names the replica actually used.
        """
        with self._lock:
            candidates = self._endpoints.get(model)
            if not candidates:
                return None
            if exclude:
                excluded = set(exclude)
                candidates = [e for e in candidates if e.replica_id not in excluded]
                if not candidates:
                    return None
            top = max(e.priority for e in candidates)
            best: list[Endpoint] = []
            best_load = float("inf")
            for e in candidates:
                if e.priority != top:
                    continue
                load = e.load
                if load < best_load:
                    best, best_load = [e], load
                elif load == best_load:
                    best.append(e)
            turn = self._turn.get(model, 0)
            chosen = best[turn % len(best)]
            self._turn[model] = turn + 1
            chosen.outstanding += 1
            self._stamps[chosen.replica_id] = self._clock()
            return chosen

    def release(self, endpoint: Endpoint) -> None:
        """The request counted by `pick` has finished (in any way)."""
        with self._lock:
            endpoint.outstanding -= 1

    # -- last-use stamps ----------------------------------------------------------
    def take_stamps(self) -> dict[str, float]:
        """Swap out the stamps gathered since the last flush.

        A replica serving a request right now is stamped "now" as well, so a long
        stream keeps its replica in use and the idle timeout cannot stop it
        mid-answer. The cost grows with replicas, not with traffic.
        """
        with self._lock:
            stamps, self._stamps = self._stamps, {}
            busy = [e.replica_id for e in self._by_replica.values() if e.outstanding > 0]
            if busy:
                now = self._clock()
                for replica_id in busy:
                    stamps[replica_id] = now
        return stamps

    def restore_stamps(self, stamps: dict[str, float]) -> None:
        """Put back stamps a flush could not deliver; a newer stamp for the same replica wins."""
        with self._lock:
            for replica_id, ts in stamps.items():
                if ts > self._stamps.get(replica_id, float("-inf")):
                    self._stamps[replica_id] = ts

    def pending_stamps(self) -> dict[str, float]:
        with self._lock:
            return dict(self._stamps)

    def in_flight(self) -> int:
        with self._lock:
            return sum(e.outstanding for e in self._by_replica.values())
