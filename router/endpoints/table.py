"""The endpoint table as the router reads it: each ready replica an `Endpoint`, each model's and LoRA adapter's
names and notes.

The control plane publishes `hub.contracts.EndpointTable` as JSON; `decode_table`
decodes it row by row with msgspec, leaving out what is malformed rather than
failing the whole table, and the route table (router.endpoints.routes) turns it into its lookups.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field

import msgspec

from hub.contracts import AdapterEntry, EndpointRow, EndpointTable, ModelEntry, Name, UnixTime
from router.picking.ejection import ReplicaHealth

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Endpoint:
    """One ready replica of a model, as published by the control plane.

    `outstanding` counts requests this router has sent to it that have not
    finished, and `health` its failures and ejection; both survive table
    updates as long as the replica keeps its URL.
    """

    replica_id: str
    model: str
    url: str
    priority: int = 0
    weight: int = 1
    pool: str = "default"
    # The requests it runs at once (the profile's max_concurrency), past which its model's requests wait in the
    # router's fair queue (router.picking.admission); 0: no bound.
    capacity: int = 0
    outstanding: int = field(default=0, compare=False)
    health: ReplicaHealth = field(default_factory=ReplicaHealth, compare=False, repr=False)
    # The engine's own load, last polled (router.picking.engine_load): None while unknown.
    engine_waiting: float | None = field(default=None, compare=False)
    kv_usage: float | None = field(default=None, compare=False)
    # What the pick reads: unknown load counts as no extra load and never as full.
    queued: float = field(default=0.0, compare=False, repr=False)
    kv_full: bool = field(default=False, compare=False, repr=False)
    # Its engine's own bearer header (router-only mode, `EndpointRow.api_key`), built once; None: it has none.
    authorization: dict[str, str] | None = field(default=None, compare=False, repr=False)
    # Stable across routers and restarts (unlike hash() of a str), so every router prefers the same replica per key.
    affinity_seed: int = field(init=False, compare=False, repr=False)
    replica_id_bytes: bytes = field(init=False, compare=False, repr=False)  # as every answer's header names it

    def __post_init__(self) -> None:
        self.replica_id_bytes = self.replica_id.encode()
        self.affinity_seed = zlib.crc32(self.replica_id_bytes)

    @property
    def load(self) -> float:
        return (self.outstanding + self.queued) / self.weight


class TableError(ValueError):
    """An endpoint table that is not a JSON object of the published shape at all."""


class _Rows(msgspec.Struct):
    """The published table with its rows still encoded, so each row is decoded (and refused) on its own."""

    models: dict[str, msgspec.Raw] = {}
    endpoints: list[msgspec.Raw] = []
    adapters: dict[str, msgspec.Raw] = {}
    moving: msgspec.Raw = msgspec.Raw(b"{}")
    fingerprint: str = ""


class _Aliases(msgspec.Struct):
    """What is kept of a model entry whose notes are malformed: its aliases."""

    aliases: list[str] = []


_decode_rows = msgspec.json.Decoder(_Rows).decode
_decode_model = msgspec.json.Decoder(ModelEntry).decode
_decode_aliases = msgspec.json.Decoder(_Aliases).decode
_decode_endpoint = msgspec.json.Decoder(EndpointRow).decode
_decode_adapter = msgspec.json.Decoder(AdapterEntry).decode
_decode_moving = msgspec.json.Decoder(dict[Name, UnixTime]).decode


def decode_table(data: bytes) -> EndpointTable:
    """The table as the hub hands it over; one malformed row is logged and left out, never the whole table.

    A malformed endpoint row is dropped. A malformed model entry keeps its name (it is the key, so it is
    sound) and what of its aliases is sound, and loses its notes: dropping the model would answer its
    requests "no such model". A malformed adapter entry is dropped: without its base it cannot be served.
    Malformed moves are all left out. TableError when `data` is not a table at all.
    """
    try:
        rows = _decode_rows(data)
    except msgspec.DecodeError as exc:
        raise TableError(f"endpoint table is not an object of the published shape: {exc}") from None
    models = {name: _model_entry(name, raw) for name, raw in rows.models.items()}
    endpoints = []
    for raw in rows.endpoints:
        try:
            endpoints.append(_decode_endpoint(raw))
        except msgspec.DecodeError as exc:
            log.warning("skipping an endpoint of the table (%s): %s", exc, _excerpt(raw))
    adapters = {}
    for name, raw in rows.adapters.items():
        try:
            adapters[name] = _decode_adapter(raw)
        except msgspec.DecodeError as exc:
            log.warning("skipping adapter %r of the endpoint table (%s): %s", name, exc, _excerpt(raw))
    try:
        moving = _decode_moving(rows.moving)
    except msgspec.DecodeError as exc:
        # Streams are then left to finish on their engines, or to break and be continued, as without the moves.
        log.warning("ignoring the endpoint table's moves (%s): %s", exc, _excerpt(rows.moving))
        moving = {}
    return EndpointTable(
        models=models, endpoints=endpoints, adapters=adapters, moving=moving, fingerprint=rows.fingerprint
    )


def _model_entry(name: str, raw: msgspec.Raw) -> ModelEntry:
    try:
        return _decode_model(raw)
    except msgspec.DecodeError as exc:
        log.warning("model %r of the endpoint table: ignoring its notes (%s): %s", name, exc, _excerpt(raw))
    try:
        return ModelEntry(aliases=_decode_aliases(raw).aliases)
    except msgspec.DecodeError:
        return ModelEntry()


def _excerpt(raw: msgspec.Raw) -> str:
    """The start of a row as it was published, for the log line."""
    return bytes(raw)[:200].decode(errors="replace")


# How a model's broken streams are continued (router.forwarding.continuation): not at all, from the text sent so far
# (the default), or by token ids (its engines give and take them).
STREAMS_OFF, STREAMS_BY_TEXT, STREAMS_BY_IDS = 0, 1, 2


@dataclass(slots=True)
class ModelLookups:
    """What the route table looks up by name in the table's `models` and `adapters`: each dict keyed by public name
    (`names` by public name or alias, of models and adapters alike), a model left out of a dict where its entry
    says nothing of it."""

    names: dict[str, str] = field(default_factory=dict)  # name or alias -> public name
    adapters: dict[str, AdapterEntry] = field(default_factory=dict)  # those riding on a model of the table
    catalog: dict[str, list[str]] = field(default_factory=dict)  # public name -> aliases
    unplaceable: dict[str, tuple[str, frozenset[str]]] = field(default_factory=dict)  # why, for keys of which pools
    start_failed: dict[str, str] = field(default_factory=dict)
    start_seconds: dict[str, float] = field(default_factory=dict)
    holding: dict[str, str] = field(default_factory=dict)
    pools: dict[str, frozenset[str]] = field(default_factory=dict)  # a model's profiles' pools, when published
    # How a broken stream is continued (STREAMS_OFF, STREAMS_BY_IDS), for the names whose way is not the default
    # (STREAMS_BY_TEXT); an adapter's is its base's.
    streams: dict[str, int] = field(default_factory=dict)
    # Public name -> (input price, output price, output bound) of the names whose tokens cost something
    # (hub.contracts.ModelEntry): what budgets reserve and settle with.
    prices: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    # The names whose engines order their own queue by a request's `priority` (an adapter's is its base's).
    by_priority: set[str] = field(default_factory=set)


def model_lookups(models: dict[str, ModelEntry], adapters: dict[str, AdapterEntry] | None = None) -> ModelLookups:
    """The route table's lookups from the table's `models` and `adapters`.

    The catalog keeps names of models, adapters and their aliases apart; should a table clash all the same, a
    public name wins over an alias and a model over an adapter. An adapter whose base is not a model of the
    table is left out: nothing could serve it.
    """
    found = ModelLookups()
    for public, entry in models.items():
        found.catalog[public] = entry.aliases
        if entry.unplaceable is not None:
            found.unplaceable[public] = (entry.unplaceable, frozenset(entry.unplaceable_pools))
        if entry.failed is not None:
            found.start_failed[public] = entry.failed
        if entry.start_seconds is not None:
            found.start_seconds[public] = entry.start_seconds
        if entry.holding is not None:
            found.holding[public] = entry.holding
        if entry.pools:
            found.pools[public] = frozenset(entry.pools)
        if not entry.continue_streams or entry.token_ids:
            found.streams[public] = STREAMS_BY_IDS if entry.continue_streams else STREAMS_OFF
        found.names[public] = public
        if entry.price_input or entry.price_output:
            found.prices[public] = (entry.price_input, entry.price_output, entry.output_bound)
        if entry.priority_scheduling:
            found.by_priority.add(public)
    for public, adapter in (adapters or {}).items():
        if adapter.base in models and public not in found.names:
            found.adapters[public] = adapter
            found.names[public] = public
            if adapter.base in found.streams:
                found.streams[public] = found.streams[adapter.base]
            if adapter.base in found.by_priority:
                found.by_priority.add(public)
            if adapter.price_input or adapter.price_output:
                found.prices[public] = (adapter.price_input, adapter.price_output, models[adapter.base].output_bound)
    aliases = [(public, entry.aliases) for public, entry in models.items()]
    aliases += [(public, adapter.aliases) for public, adapter in found.adapters.items()]
    for public, names in aliases:
        for alias in names:
            found.names.setdefault(alias, public)
    return found


def adapter_holders(adapters: dict[str, AdapterEntry], by_replica: dict[str, Endpoint]) -> dict[str, list[Endpoint]]:
    """Public adapter name -> the ready replicas of its base that hold it (a replica the table does not list
    among its endpoints, or of another model, is left out)."""
    holders: dict[str, list[Endpoint]] = {}
    for public, adapter in adapters.items():
        found = [by_replica[r] for r in adapter.replicas if r in by_replica]
        holders[public] = [e for e in found if e.model == adapter.base]
    return holders


def endpoint_of(row: EndpointRow) -> Endpoint:
    """The router's Endpoint for a published row."""
    capacity = 0 if row.capacity is msgspec.UNSET else row.capacity
    endpoint = Endpoint(row.replica_id, row.model, row.url.rstrip("/"), row.priority, row.weight, row.pool, capacity)
    if row.api_key is not msgspec.UNSET:
        endpoint.authorization = {"Authorization": f"Bearer {row.api_key}"}
    return endpoint
