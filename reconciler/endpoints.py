"""The endpoint table routers serve from, built from the rows (published by the tick, DESIGN invariant 7)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

import msgspec
from django.conf import settings
from django.db.models import Exists, OuterRef, TextField
from django.db.models.functions import Cast

from catalog.choices import Engine
from catalog.engine_flags import schedules_by_priority
from catalog.models import Adapter, Alias, Profile
from hub.contracts import AdapterEntry, EndpointRow, EndpointTable, Holding, ModelEntry
from inventory.choices import STAGING_UNDER_WAY, NodeState
from inventory.models import WeightsStage
from nodewire.weights.disk import weights_key
from reconciler.choices import AdapterLoadState, Hold, ReplicaState, ShardState
from reconciler.demand.spares import PARKED_PRIORITY
from reconciler.models import AdapterLoad, Replica, Shard

# How long before a leaving replica's drain would time out routers move the streams it still relays (seconds): room
# for the moves and the agent's poll (every 0.5 s) to find the engine idle first.
MOVE_LEAD_SECONDS = 2.0
# The most of an engine's error line a table carries: it goes to every router on every change.
FAILURE_LINE_CHARS = 300
# Engines that give token ids (vLLM's `return_token_ids`) and take token-id prompts, so a broken stream of a model
# served only by them is continued token for token (router.forwarding.continuation). The mock answers as vLLM does.
TOKEN_ID_ENGINES = frozenset({Engine.VLLM, Engine.MOCK})
# A trailing line that says nothing of the failure: pydantic's pointer under each validation error, which is
# how vLLM's configuration checks end (e.g. a --max-model-len above what the model allows).
_POINTER_PREFIX = "For further information visit https://errors.pydantic.dev/"


def failure_reason(last_error: str) -> str:
    """One line for clients from a replica's last error: what happened (the first line, e.g. "engine exited
    with code 1") and the engine's own last line of output, when the agent sent its output along."""
    lines = [line.strip() for line in last_error.strip().splitlines() if line.strip()]
    while len(lines) > 2 and lines[-1].startswith(_POINTER_PREFIX):
        lines.pop()
    if not lines:
        return "its replica failed"
    what, said = lines[0].rstrip(":"), lines[-1][:FAILURE_LINE_CHARS]
    return what if len(lines) == 1 else f"{what}: {said}"


def build_endpoint_table() -> EndpointTable:
    """Enabled models with a profile (with why a model cannot be placed, when it cannot, how long it takes
    to start, why its last replica failed, or why its requests are held when that is not a start), READY
    replicas whose nodes are all heard from, enabled LoRA adapters with the published replicas holding them, and
    when routers move the streams of replicas leaving service (`_Notes.moving`). Five queries (six with
    adapters), plain rows: it runs every tick, over every ready replica of the fleet."""
    notes = _Notes.read()
    models, endpoints = _models(notes), _endpoints()
    return EndpointTable(models=models, endpoints=endpoints, adapters=_adapters(models, endpoints), moving=notes.moving)


def _adapters(models: dict[str, ModelEntry], endpoints: list[EndpointRow]) -> dict[str, AdapterEntry]:
    """Enabled adapters of published models, by public name, with the published replicas that hold them.

    Two queries, neither with a list of names or ids in it: the fleet's loads are few (slots per replica), so
    they are all read and matched here.
    """
    # The aliases as JSON text, decoded here only where there are some: most adapters have none, and decoding
    # each row's JSON field was most of this function's time at a thousand adapters.
    rows = list(
        Adapter.objects.filter(enabled=True, base__enabled=True)
        .order_by("name")
        .values_list(
            "pk",
            "name",
            "base__name",
            Cast("aliases", TextField()),
            "price_input_per_million",
            "price_output_per_million",
        )
    )
    if not rows:
        return {}
    published = {row.replica_id for row in endpoints}
    held: dict[int, list[str]] = {}
    loading: set[int] = set()
    for adapter_id, replica_id, state in (
        AdapterLoad.objects.filter(state__in=(AdapterLoadState.LOADING, AdapterLoadState.LOADED))
        .order_by("replica_id")
        .values_list("adapter_id", "replica_id", "state")
    ):
        if str(replica_id) not in published:
            continue
        if state == AdapterLoadState.LOADED:
            held.setdefault(adapter_id, []).append(str(replica_id))
        else:
            loading.add(adapter_id)
    return {
        name: AdapterEntry(
            base=base,
            aliases=_aliases(aliases),
            replicas=held.get(pk, []),
            loading=pk in loading,
            # An adapter's own price, else its base's (catalog.prices.inherited).
            price_input=models[base].price_input if price_in is None else token_price(price_in),
            price_output=models[base].price_output if price_out is None else token_price(price_out),
        )
        for pk, name, base, aliases, price_in, price_out in rows
        if base in models
    }


def token_price(per_million: Decimal) -> int:
    """One token's price in spend units (hub.budgets.SPEND_UNITS) from a price per million tokens (six decimals)."""
    return int(per_million.scaleb(6))


def _aliases(text: str | None) -> list[str]:
    """An adapter's aliases, sorted, from their JSON text (a list of names, as the catalog validated it)."""
    if not text or text == "[]":
        return []
    return sorted(json.loads(text))


@dataclass
class _Served:
    """What a model's profiles say of it, gathered from them in one query (`_profiles`)."""

    name: str
    start: float | None  # the first profile's learned start time: an activation starts that one
    prices: tuple[int, int]  # its token prices in spend units
    pools: set[str] = field(default_factory=set)  # routers refuse at once a key bound to none of them
    engines: set[str] = field(default_factory=set)  # whether routers may ask for token ids depends on all of them
    continues: bool = False  # whether routers continue its broken streams
    bound: int = 0  # the largest context a profile serves it with
    by_priority: bool = True  # whether every profile's engine orders its own queue by a request's priority


def _profiles() -> dict[int, _Served]:
    """Every enabled model with a profile, by id, as its profiles (in order) describe it; one query."""
    served: dict[int, _Served] = {}
    for model_id, name, start_seconds, pool, continues, engine, price_in, price_out, context, args in (
        Profile.objects.filter(model__enabled=True)
        .order_by("model_id", "order", "id")
        .values_list(
            "model_id",
            "model__name",
            "start_seconds",
            "pool",
            "model__continue_streams",
            "engine",
            "model__price_input_per_million",
            "model__price_output_per_million",
            "max_model_len",
            "engine_args",
        )
    ):
        model = served.get(model_id)
        if model is None:
            model = served[model_id] = _Served(name, start_seconds, (token_price(price_in), token_price(price_out)))
        model.pools.add(pool)
        model.engines.add(engine)
        model.continues = continues
        model.bound = max(model.bound, context or 0)
        model.by_priority = model.by_priority and schedules_by_priority(engine, list(args or []))
    return served


def _models(notes: _Notes) -> dict[str, ModelEntry]:
    """Every enabled model with a profile, by public name (sorted), with its aliases, notes and its profiles' pools.
    Two queries: profiles and aliases (`notes`: the replicas that are not serving)."""
    served = _profiles()
    aliases: dict[int, list[str]] = {model_id: [] for model_id in served}
    for model_id, alias in Alias.objects.filter(model__enabled=True).values_list("model_id", "name"):
        if model_id in aliases:
            aliases[model_id].append(alias)
    holding = dict(notes.holding)
    # A model whose only replicas sleep is woken, not started: its ETA is the wake time (reconciler.hibernate.tier),
    # unknown until one wake has been timed (a start time would overstate it many times over).
    for model_id, wake in notes.sleeping_only.items():
        if model_id in served:
            served[model_id].start = wake
            # Only sleepers, so no pending replica whose making-room note this could overwrite.
            holding[served[model_id].name] = "wake"
    staging_left = _staging_left(notes.staging)
    models: dict[str, ModelEntry] = {}
    for model_id, model in sorted(served.items(), key=lambda item: item[1].name):
        name, start = model.name, model.start
        if name in staging_left:
            start = (start or 0.0) + staging_left[name]
        note, note_pools = notes.unplaceable.get(name, (None, []))
        models[name] = ModelEntry(
            aliases=sorted(aliases[model_id]),
            unplaceable=note,
            unplaceable_pools=note_pools,
            failed=notes.failed.get(name),
            start_seconds=None if start is None else round(start, 1),
            holding=holding.get(name),
            pools=sorted(model.pools),
            continue_streams=model.continues,
            token_ids=model.engines <= TOKEN_ID_ENGINES,
            price_input=model.prices[0],
            price_output=model.prices[1],
            output_bound=model.bound,
            priority_scheduling=model.by_priority,
        )
    return models


def _endpoints() -> list[EndpointRow]:
    """READY replicas of enabled models whose shards' nodes are all heard from, by replica id."""
    # A replica with a shard on a node that missed its heartbeat window takes no traffic; it
    # returns when the node's heartbeats do (DESIGN "Reconcile tick": unreachable → unpublished).
    on_silent_node = Shard.objects.filter(replica=OuterRef("pk")).exclude(node__state=NodeState.READY)
    rows = (
        Replica.objects.ready()
        .filter(model__enabled=True)
        .exclude(Exists(on_silent_node))
        .order_by("id")
        .values_list(
            "id",
            "model__name",
            "endpoint_url",
            "profile__priority",
            "profile__weight",
            "profile__pool",
            "profile__max_concurrency",
            "parked_since",
        )
    )
    return [
        EndpointRow(
            replica_id=str(pk),
            model=model,
            url=url,
            # A parked spare takes requests only when no other replica can (reconciler.demand.spares).
            priority=priority if parked is None else PARKED_PRIORITY,
            weight=weight,
            pool=pool,
            capacity=msgspec.UNSET if capacity is None else capacity,
        )
        for pk, model, url, priority, weight, pool, capacity, parked in rows
    ]


@dataclass
class _Notes:
    """What the table says of models that are not simply served, from their replicas not serving (pending, asleep,
    waking, failed, stopping: few in a steady fleet), read in one query.

    * `unplaceable`: why a wanted model has no room right now, so routers answer at once instead of holding
      requests, with the pools that replica is bound to (empty: none, and then its note wins, as it speaks for
      every key);
    * `holding`: the models room is being made for, whose requests routers hold;
    * `sleeping_only`: model id -> learned wake time, for models whose wanted replicas are all sleepers;
    * `failed`: a model whose only wanted replica failed (its engine exited, in its start or later) -> the
      engine's words, so routers answer at once instead of holding requests until their deadline. A replica
      pending or starting again (after the backoff) withdraws it: then requests wait for it;
    * `moving`: replica id -> when routers move the streams it still relays, for replicas stopping or going to
      sleep whose head engine still runs (`moving_at`).
    """

    unplaceable: dict[str, tuple[str, list[str]]] = field(default_factory=dict)
    holding: dict[str, Holding] = field(default_factory=dict)
    sleeping_only: dict[int, float | None] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    moving: dict[str, float] = field(default_factory=dict)
    staging: dict[str, str] = field(default_factory=dict)  # model name -> weights key, while it waits for a stage

    @classmethod
    def read(cls) -> _Notes:
        serving = Replica.objects.filter(model=OuterRef("model"), state__in=_SERVING)
        wanted = Replica.objects.filter(model=OuterRef("model"), state__in=(*_SERVING, *_SLEEPERS))
        running = Shard.objects.filter(replica=OuterRef("pk"), rank=0).exclude(state__in=_ENGINE_DONE)
        found = (
            Replica.objects.filter(model__enabled=True, state__in=_NOT_SERVING)
            .annotate(serving=Exists(serving), wanted=Exists(wanted), running=Exists(running))
            .values_list(
                "id", "model_id", "model__name", "state", "placement_note", "hold", "pools", "profile__order",
                "profile__wake_seconds", "last_error", "serving", "wanted", "running", "stopping_since",
                "sleeping_since", "profile__engine", "model__source", named=True,
            )
        )  # fmt: skip
        rows = sorted(found, key=lambda row: row.id)
        notes = cls()
        # Pending replicas in placement order: a model's first profile speaks first.
        for row in sorted(
            (r for r in rows if r.state == ReplicaState.PENDING), key=lambda r: (r.model__name, r.profile__order, r.id)
        ):
            name, reason, hold, pools = row.model__name, row.placement_note, row.hold, row.pools
            if not reason and hold == Hold.NONE:
                continue  # placed at its last attempt (no note) and holding nothing: nothing to say of it
            if hold == Hold.MAKING_ROOM:
                notes.holding[name] = "making_room"
            elif hold == Hold.STAGING:
                notes.holding[name] = "staging"
                notes.staging[name] = weights_key(row.profile__engine, row.model__source)
            elif hold == Hold.NONE and (name not in notes.unplaceable or (notes.unplaceable[name][1] and not pools)):
                notes.unplaceable[name] = (reason, pools)
            # Otherwise nodes may still report in: routers keep holding its requests, as for a start.
        for row in rows:
            if row.state in _SLEEPERS and not row.serving:
                notes.sleeping_only.setdefault(row.model_id, row.profile__wake_seconds)  # the oldest sleeper's
        for row in reversed(rows):
            if row.state == ReplicaState.FAILED and not row.wanted:
                notes.failed.setdefault(row.model__name, failure_reason(row.last_error))  # the newest failure's
        for row in rows:
            since = row.stopping_since if row.state == ReplicaState.STOPPING else row.sleeping_since
            if row.running and since is not None and row.state in (ReplicaState.STOPPING, ReplicaState.SLEEPING):
                notes.moving[str(row.id)] = moving_at(since)
        return notes


# A stage's time left is published in steps this long, so its progress changes the table a few times a minute,
# not at every report.
STAGING_ETA_STEP_SECONDS = 15


def _staging_left(staging: dict[str, str]) -> dict[str, float]:
    """Per model waiting for a stage, the seconds its slowest stage has left at its current rate, rounded up to
    STAGING_ETA_STEP_SECONDS (a stage with no rate yet counts one step). One query, none when nothing stages."""
    if not staging:
        return {}
    left: dict[str, float] = {}
    for stage in WeightsStage.objects.filter(source__in=set(staging.values()), state__in=STAGING_UNDER_WAY):
        seconds = stage.seconds_left
        for name, key in staging.items():
            if key == stage.source:
                steps = 1 if seconds is None else max(1, math.ceil(seconds / STAGING_ETA_STEP_SECONDS))
                left[name] = max(left.get(name, 0.0), float(steps * STAGING_ETA_STEP_SECONDS))
    return left


def moving_at(since: datetime) -> float:
    """When (Unix time) routers move the streams of a replica that left the table at `since` for a stop or a sleep.

    Its engine finishes what it holds for up to LLMGW_DRAIN_TIMEOUT_SECONDS from its drain (or sleep), sent an
    unpublish grace after `since`; routers move what it still relays MOVE_LEAD_SECONDS before that timeout would
    pass counted from `since`, so the engine is found idle and stopped (or put to sleep) with no stream cut. A
    stream that cannot be continued is left to finish (router.forwarding.moves).
    """
    wait = max(0.0, settings.LLMGW_DRAIN_TIMEOUT_SECONDS - MOVE_LEAD_SECONDS)
    return round(since.timestamp() + wait, 3)


_SERVING = (ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.READY)
_SLEEPERS = (ReplicaState.SLEEPING, ReplicaState.WAKING)
_NOT_SERVING = (ReplicaState.PENDING, ReplicaState.FAILED, *_SLEEPERS, ReplicaState.STOPPING)
# A head shard in these states runs no engine that could hold a stream (asleep, stopped, exited).
_ENGINE_DONE = (ShardState.SLEEPING, ShardState.STOPPED, ShardState.FAILED)
