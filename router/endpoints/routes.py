"""The route table: what the router knows by name, rebuilt from each endpoint table the control plane publishes.

Public names and aliases of models and adapters, each model's ready replicas
(an adapter's: the replicas of its base that hold it), and the control
plane's notes on each model (why it cannot be placed, why its start failed,
how long a start takes, why its requests are held, its pools). It answers
lookups only: picking a replica is the picker's (router.picking.picker),
counting use the ledger's (router.accounting.ledger). Only the router's
event loop reads and installs it, so it takes no lock.
"""

from __future__ import annotations

from hub.contracts import AdapterEntry, EndpointTable
from router.endpoints.table import (
    STREAMS_BY_IDS,
    STREAMS_BY_TEXT,
    STREAMS_OFF,
    Endpoint,
    adapter_holders,
    endpoint_of,
    model_lookups,
)

# Why a request for an adapter is held while a running replica of its base is to load it (a hold's reason label).
ADAPTER_LOAD = "adapter_load"


class RouteTable:
    """Names, aliases, notes and ready replicas per public name, as of the last table installed.

    `by_model` (public name -> ready replicas) and `by_replica` are read by
    the picker and the ledger on every request; only `apply_table` writes them.
    """

    def __init__(self) -> None:
        self._names: dict[str, str] = {}  # public name or alias -> public name
        self._catalog: dict[str, list[str]] = {}  # public name -> aliases
        self._unplaceable: dict[str, tuple[str, frozenset[str]]] = {}  # public name -> why it cannot be placed now
        self._start_failed: dict[str, str] = {}  # public name -> why its only replica failed
        self._start_seconds: dict[str, float] = {}  # public name -> learned time from placement to ready
        self._holding: dict[str, str] = {}  # public name -> why its requests are held, when not a start
        self._pools: dict[str, frozenset[str]] = {}  # public name -> its profiles' pools, when published
        self._adapters: dict[str, AdapterEntry] = {}  # public adapter name -> its entry
        # Public name -> how its broken streams are continued, where not by text (router.endpoints.table): read on
        # every stream's way, as `streams.get(model, STREAMS_BY_TEXT)`.
        self.streams: dict[str, int] = {}
        # Public name -> (input price, output price, output bound) where its tokens cost something: read for every
        # request of a key with budgets, and for every answer's spend.
        self.prices: dict[str, tuple[int, int, int]] = {}
        # The public names whose engines order their queue by a request's `priority`: each request is given its
        # class's rank (router.app).
        self.by_priority: set[str] = set()
        self.by_model: dict[str, list[Endpoint]] = {}  # public name -> ready replicas (an adapter's: holding it)
        self.by_replica: dict[str, Endpoint] = {}
        # Replica id -> when (Unix time) to move the streams it still relays (router.forwarding.moves).
        self.moving: dict[str, float] = {}
        self.fingerprint: str | None = None
        self.generation = 0  # tables installed so far: what was derived from one table is stale after it

    def apply_table(self, table: EndpointTable) -> bool:
        """Install a published table (router.endpoints.table decoded it); return False when it is the one already installed.

        A replica published again at the same URL keeps its Endpoint object, so the requests in flight on it,
        its health and its engine's load carry over."""
        fingerprint = table.fingerprint or None
        if fingerprint is not None and fingerprint == self.fingerprint:
            return False
        lookups = model_lookups(table.models, table.adapters)
        catalog = lookups.catalog

        by_model: dict[str, list[Endpoint]] = {}
        by_replica: dict[str, Endpoint] = {}
        for row in table.endpoints:
            fresh = endpoint_of(row)
            if fresh.model not in catalog:
                continue
            current = self.by_replica.get(fresh.replica_id)
            if current is not None and current.url == fresh.url and current.model == fresh.model:
                current.priority, current.weight, current.pool = fresh.priority, fresh.weight, fresh.pool
                current.capacity = fresh.capacity
                current.authorization = fresh.authorization
                fresh = current
            by_replica[fresh.replica_id] = fresh
            by_model.setdefault(fresh.model, []).append(fresh)
        by_model.update(adapter_holders(lookups.adapters, by_replica))  # names of models and adapters never clash
        self._adapters = lookups.adapters
        self._names, self._catalog, self._unplaceable = lookups.names, catalog, lookups.unplaceable
        self._start_seconds, self._start_failed = lookups.start_seconds, lookups.start_failed
        self._holding, self._pools = lookups.holding, lookups.pools
        self.streams = lookups.streams
        self.prices = lookups.prices
        self.by_priority = lookups.by_priority
        self.by_model, self.by_replica = by_model, by_replica
        self.moving = table.moving
        self.fingerprint = fingerprint
        self.generation += 1
        return True

    def resolve(self, name: str) -> str | None:
        """The public name `name` refers to (itself or the model it is an alias of), or None."""
        return self._names.get(name)

    def base_of(self, name: str) -> str | None:
        """The base model of the adapter whose public name is `name`; None when `name` is not an adapter's."""
        adapter = self._adapters.get(name)
        return None if adapter is None else adapter.base

    def adapters(self) -> dict[str, AdapterEntry]:
        """Public adapter name -> its entry (base, aliases, holders), as last published."""
        return self._adapters

    def catalog(self) -> dict[str, list[str]]:
        """Public model name -> aliases, as last published."""
        return self._catalog

    def endpoints(self, model: str | None = None) -> list[Endpoint]:
        """The ready replicas of `model` (an adapter: those holding it); of every model when None."""
        if model is not None:
            return list(self.by_model.get(model, ()))
        return list(self.by_replica.values())

    def has_choice(self, model: str) -> bool:
        """Whether `model` (or adapter) has more than one ready replica to choose from."""
        return len(self.by_model.get(model, ())) > 1

    def serves_pools(self, model: str, pools: frozenset[str]) -> bool:
        """Whether `model` (an adapter: its base) has a profile in `pools` (empty: any); unknown pools refuse none."""
        have = self._pools.get(self._adapters[model].base if model in self._adapters else model)
        return not pools or have is None or not have.isdisjoint(pools)

    def continues(self, model: str) -> bool:
        """Whether a broken answer of `model` (an adapter: of its base) is continued on another replica."""
        return self.streams.get(model, STREAMS_BY_TEXT) != STREAMS_OFF

    def gives_token_ids(self, model: str) -> bool:
        """Whether `model`'s engines (an adapter's: its base's) give token ids and take token-id prompts."""
        return self.streams.get(model) == STREAMS_BY_IDS

    # -- the control plane's notes, for requests held --------------------------------
    # Whose notes speak for a hold of `model`'s requests: its own; an adapter's, its base's while the base has no
    # ready replica (nothing can load it before one starts), and none while one runs (loading it is all it takes).
    def _notes_of(self, model: str) -> str:
        adapter = self._adapters.get(model)
        if adapter is None:
            return model
        return "" if self.by_model.get(adapter.base) else adapter.base

    def unplaceable(self, model: str, pools: frozenset[str] | None = None) -> str | None:
        """Why the control plane could not place `model` (an adapter: its idle base) for a key bound to `pools`
        (None: to none) at its last attempt, or None. A note on a start in some pools answers only keys of them all."""
        note = self._unplaceable.get(self._notes_of(model))
        return note[0] if note is not None and note[1] <= (pools or frozenset()) else None

    def start_failure(self, model: str) -> str | None:
        """Why `model`'s (an adapter: its idle base's) only replica failed (the engine's last words), or None."""
        return self._start_failed.get(self._notes_of(model))

    def start_seconds(self, model: str) -> float | None:
        """How long `model` (an adapter: its idle base) has taken to start (learned), or None if unknown."""
        return self._start_seconds.get(self._notes_of(model))

    def holding(self, model: str) -> str | None:
        """Why the control plane holds `model`'s requests when that is not a start (`wake`, `making_room`), or None.

        An adapter's: ADAPTER_LOAD while its load is under way or its base runs (a load is all it waits for),
        else its base's reason."""
        adapter = self._adapters.get(model)
        if adapter is not None and (adapter.loading or self.by_model.get(adapter.base)):
            return ADAPTER_LOAD
        return self._holding.get(self._notes_of(model))
