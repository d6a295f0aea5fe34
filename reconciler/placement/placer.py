"""Putting pending replicas on GPUs, and (re)sending the start commands that follow.

A replica goes on the first of its model's profiles with room (profile
fallback; only those in its pools when it was created for a key bound to
some, `Replica.pools`); when none has room, `room.make_room` may evict
replicas for it (idle ones; in use too once the requests it is held for have
waited the one bound, from the first tick it found no room:
`Replica.wanted_since`).
The placer (`placement.place`) decides on a capacity snapshot in memory,
preferring nodes that hold the profile's weights on disk; this module reads
the rows once (one query for the weights of every candidate source), writes
shards and GPU assignments in bulk, and queues one start_shard per shard in
the tick's Outbox. A unique constraint on
GPUAssignment.gpu backs the arithmetic (DESIGN invariant 2).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import BigIntegerField, Case, CharField, Count, Exists, OuterRef, Q, Value, When

from catalog.models import Profile
from catalog.sizing import ReportedWeights, reported_from_row
from inventory.models import Weights
from nodewire.weights.disk import weights_key
from reconciler.choices import Hold, ReplicaState, ShardState
from reconciler.hibernate.tier import sleep_level
from reconciler.lifecycle.transitions import head_started, send_starts, start_command
from reconciler.models import GPUAssignment, PendingCommand, Replica, Shard
from reconciler.outbox import Outbox
from reconciler.placement.capacity import CapacitySnapshot, free_capacity
from reconciler.placement.fit import MemoryCheck
from reconciler.placement.room import PlacementNote, make_room
from reconciler.placement.search import Placement, Shape, Unplaceable, on_node, pick_port, place
from reconciler.weights.budget import mark_used
from reconciler.weights.staging import Stages, key_of


@dataclass
class _NewShard:
    """A shard being placed this tick, with what its start command needs."""

    shard: Shard
    node_name: str
    address: str
    gpu_ids: list[int]
    indices: tuple[int, ...]


@dataclass
class PlacingOutcome:
    """What placing did this tick."""

    placed: int = 0
    staging: int = 0
    unplaceable: int = 0
    starts_sent: int = 0
    # Unplaceable replicas for which no room is being made either (no eviction, not waiting for nodes).
    no_room: set[int] = field(default_factory=set)


def place_pending(
    now: datetime,
    epoch: int,
    outbox: Outbox,
    *,
    eviction_paused: str = "",
    settling: Callable[[], bool] = lambda: False,
) -> PlacingOutcome:
    """Place PENDING replicas, highest priority then oldest first, each on the first of its model's profiles
    with room (and below that profile's own max); bulk-write shards and GPU assignments.

    A replica no profile can take may have idle replicas stopped to make room
    for it (`room.make_room`) — unless `eviction_paused` says why not this tick
    (idleness unknown, the partition brake): then it is held if eviction would
    make room once it may act, and nothing is stopped.
    While `settling()` (the fleet may not have reported in yet; asked only when
    a replica finds no room), one that finds no room is noted as waiting for
    nodes, not unplaceable: routers hold its requests.
    """
    outcome = PlacingOutcome()
    pending = list(
        Replica.objects.filter(state=ReplicaState.PENDING, model__enabled=True)
        .select_related("model", "profile__model")
        .order_by("-profile__priority", "created_at", "id")
    )
    if not pending:
        return outcome
    profiles = _profiles_of({r.model_id for r in pending})
    stages = Stages.of({key_of(p) for ps in profiles.values() for p in ps})
    pending = stages.sort_waiting(pending, now)
    capacity = free_capacity(now)
    holders, reported = _weights_on_disk(profiles, stages)
    memory = MemoryCheck(reported)
    placed, moved, unplaceable = _choose(pending, profiles, capacity, memory, holders)
    placed, moved = _wait_for_staging(placed, moved, stages, holders, outbox)
    stages.write(now, outbox)
    outcome.staging = len(stages.staged)

    notes = make_room(unplaceable, capacity, now, memory, paused=eviction_paused) if unplaceable else {}
    if unplaceable and settling():
        for replica, _tried, reason in unplaceable:
            notes.setdefault(replica.pk, PlacementNote.waiting_for_nodes(reason))
    outcome.no_room = {replica.pk for replica, _, _ in unplaceable if replica.pk not in notes}
    outcome.unplaceable = len(unplaceable)
    _write_placed(placed, moved, now, epoch)
    mark_used(((new.shard.node_id, key_of(replica.profile)) for replica, shards in placed for new in shards), now)
    _write_notes([(replica, notes.get(replica.pk, PlacementNote(reason))) for replica, _, reason in unplaceable], now)
    for replica, shards in placed:
        head = shards[0]
        # Rank 0 only: the others start once its engine runs (lifecycle.start_followers).
        # The engine listens where mark_ready_if_whole publishes it: the effective address, else the node name.
        start = start_command(
            head.shard, replica, len(shards), head.address, head.indices, head.address, head.shard.port
        )
        outbox.start(head.node_name, start)
        outcome.starts_sent += 1
    outcome.placed = len(placed)
    return outcome


def _wait_for_staging(
    placed: _Placed, moved: list[Replica], stages: Stages, holders: dict[int, frozenset[str]], outbox: Outbox
) -> tuple[_Placed, list[Replica]]:
    """Those placed and moved, but the replicas placed on nodes without their hub weights: they wait for them
    instead, holding no GPU (reconciler.weights.staging). The GPUs they were given stay taken in this tick's
    snapshot only; the next tick offers them to others."""
    placed = [
        (replica, shards)
        for replica, shards in placed
        if not stages.stage_instead(
            replica, [s.node_name for s in shards], holders.get(replica.profile.pk, frozenset()), outbox
        )
    ]
    return placed, [replica for replica in moved if replica not in stages.staged]


def room_now(replica: Replica, now: datetime, replacing: int) -> bool:
    """Whether the unsaved PENDING `replica` would be placed on free GPUs now, by the rules place_pending
    places by (profiles in order, their max, the memory check, weights on disk), in place of the replica
    `replacing` (not counted against a profile's max); nothing is written. For a swap that would wait longer
    than a cold start elsewhere (reconciler.hibernate.swap). A constant number of queries."""
    profiles = _profiles_of({replica.model_id})
    holders, reported = _weights_on_disk(profiles)
    running_on = _running_per_profile(profiles, leaving=replacing)
    placed, _, _ = _choose([replica], profiles, free_capacity(now), MemoryCheck(reported), holders, running_on)
    return bool(placed)


_Placed = list[tuple[Replica, list[_NewShard]]]
_Unplaceable = list[tuple[Replica, list[Profile], str]]


def _choose(
    pending: list[Replica],
    profiles: dict[int, list[Profile]],
    capacity: CapacitySnapshot,
    memory: MemoryCheck,
    holders: dict[int, frozenset[str]],
    running_on: dict[int, int] | None = None,
) -> tuple[_Placed, list[Replica], _Unplaceable]:
    """Each pending replica on the first of its profiles with room, taken from `capacity` in memory.

    Returns those placed (with their new shards), those of them that moved to
    another profile, and those without room (with the profiles tried and why
    not). A profile no node's GPUs can hold (`memory`) is not tried, so no room
    is made for it either. One query for running counts, unless given (`running_on`).
    """
    running_on = _running_per_profile(profiles) if running_on is None else running_on
    placed: _Placed = []
    moved: list[Replica] = []
    unplaceable: _Unplaceable = []
    for replica in pending:
        tried, reasons = [], []
        candidates = _profiles_in(profiles[replica.model_id], replica.pools)
        for profile in candidates:
            if running_on[profile.pk] >= profile.max_replicas:
                reasons.append(f"{shape_label(profile)}: at its max of {profile.max_replicas}")
                continue
            refusal = memory.refusal(capacity, profile)
            if refusal is not None:
                reasons.append(f"{shape_label(profile)}: {refusal}")
                continue
            tried.append(profile)
            result = _place_one(replica, profile, capacity, holders.get(profile.pk, frozenset()), memory)
            if isinstance(result, Unplaceable):
                reasons.append(f"{shape_label(profile)}: {result.reason}")
                continue
            if profile.pk != replica.profile_id:
                replica.profile = profile
                moved.append(replica)
            running_on[profile.pk] += 1
            # Decided here, where the profile row (with its model) and this tick's estimate are at hand.
            replica.weights_bytes = memory.weights_bytes(profile)
            replica.sleep_level = sleep_level(profile.engine, profile.sleep_level, replica.weights_bytes) or None
            placed.append((replica, result))
            break
        else:
            # One profile: the placer's own words; several: each profile's, in order.
            if len(candidates) == 1:
                reasons = [reason.split(": ", 1)[1] for reason in reasons]
            unplaceable.append((replica, tried, _in_pools(replica.pools, "; ".join(reasons))))
    return placed, moved, unplaceable


def _write_placed(placed: _Placed, moved: list[Replica], now: datetime, epoch: int) -> None:
    """Shards, GPU assignments and the placed replicas' new state, in bulk."""
    if not placed:
        return
    new_shards = [new for _, shards in placed for new in shards]
    Shard.objects.bulk_create([new.shard for new in new_shards])
    GPUAssignment.objects.bulk_create(
        [GPUAssignment(gpu_id=gpu_id, shard=new.shard) for new in new_shards for gpu_id in new.gpu_ids]
    )
    # Every placed replica changes the same way: one UPDATE, not one CASE per row. A new
    # incarnation has not been used yet: its last use is unknown until it is ready (invariant 3).
    # Placed, it no longer depends on anyone still waiting for it, and no longer holds requests.
    # Its engine is started able to sleep at the level its profile allows now (reconciler.hibernate.tier); the
    # replica keeps that level, whatever the profile says later, because the engine's flags are fixed at start.
    levels: dict[int, list[int]] = defaultdict(list)
    for replica, _ in placed:
        if replica.sleep_level:
            levels[replica.sleep_level].append(replica.pk)
    Replica.objects.filter(pk__in=[replica.pk for replica, _ in placed]).update(
        sleep_level=Case(*(When(pk__in=ids, then=Value(level)) for level, ids in levels.items()), default=None),
        weights_bytes=Case(
            *(When(pk=replica.pk, then=Value(replica.weights_bytes)) for replica, _ in placed if replica.weights_bytes),
            default=None,
            output_field=BigIntegerField(),
        ),
        source=Case(
            *(When(pk=replica.pk, then=Value(replica.model.source)) for replica, _ in placed),
            default=Value(""),
            output_field=CharField(),
        ),
        state=ReplicaState.STARTING,
        started_at=now,
        epoch=epoch,
        placement_note="",
        hold=Hold.NONE,
        endpoint_url="",
        ready_at=None,
        last_used=None,
        demand_until=None,
        wanted_since=None,
    )
    # Replicas that landed on a fallback profile move to it (one UPDATE for all of them).
    if moved:
        Replica.objects.bulk_update(moved, ["profile"])


def _write_notes(notes: list[tuple[Replica, PlacementNote]], now: datetime) -> None:
    """Each unplaced replica's note and hold, together, and since when it waits for room (`wanted_since`, stamped
    the first tick it finds none: the one bound of `room.make_room` counts from it); one UPDATE for those that
    changed."""
    changed = []
    for replica, note in notes:
        if (replica.placement_note, replica.hold) != (note.text, note.hold) or replica.wanted_since is None:
            replica.placement_note, replica.hold = note.text, note.hold
            replica.wanted_since = replica.wanted_since or now
            changed.append(replica)
    if changed:
        Replica.objects.bulk_update(changed, ["placement_note", "hold", "wanted_since"])


def _profiles_in(profiles: list[Profile], pools: list[str]) -> list[Profile]:
    """The profiles (in order) a replica bound to `pools` may go on: those in one of them; all when it is not."""
    return [p for p in profiles if p.pool in pools] if pools else profiles


def _in_pools(pools: list[str], reason: str) -> str:
    """Why a replica bound to `pools` found no room, saying where it looked."""
    if not pools:
        return reason
    where = f"in pool{'s' if len(pools) > 1 else ''} {', '.join(pools)}"
    return f"{where}: {reason}" if reason else f"no profile {where}"


def shape_label(profile: Profile) -> str:
    """A profile's shape for operators: `H100-80GB×8`, or `2 nodes of H100-80GB×8`."""
    label = f"{profile.gpu_class}×{profile.gpus_per_node}"
    return f"{profile.nodes_per_replica} nodes of {label}" if profile.nodes_per_replica > 1 else label


def _profiles_of(model_ids: set[int]) -> dict[int, list[Profile]]:
    """Each model's profiles, in the order they are tried. One query."""
    profiles: dict[int, list[Profile]] = defaultdict(list)
    for profile in Profile.objects.filter(model_id__in=model_ids).select_related("model").order_by("order", "id"):
        profiles[profile.model_id].append(profile)
    return profiles


def _running_per_profile(profiles: dict[int, list[Profile]], leaving: int | None = None) -> dict[int, int]:
    """Replicas placed (or failed, coming back) per profile, for each profile's own max, but the replica
    `leaving`. One query."""
    ids = [p.pk for ps in profiles.values() for p in ps]
    counts: dict[int, int] = defaultdict(int)
    placed = (
        Replica.objects.filter(profile_id__in=ids)
        .exclude(state__in=(ReplicaState.PENDING, ReplicaState.STOPPING))
        # A replica a node drain is replacing makes way for its replacement (reconciler.lifecycle.drain).
        .filter(drain_deadline__isnull=True)
    )
    if leaving is not None:
        placed = placed.exclude(pk=leaving)
    for profile_id, n in placed.values("profile_id").annotate(n=Count("id")).values_list("profile_id", "n"):
        counts[profile_id] = n
    return counts


def _weights_on_disk(
    profiles: dict[int, list[Profile]], stages: Stages | None = None
) -> tuple[dict[int, frozenset[str]], dict[str, ReportedWeights]]:
    """The names of the nodes holding each profile's weights on disk, and what the newest report of each
    source's headers says (for the memory check: catalog.sizing). One query.

    A node reports a hub repository or a GGUF path relative to its root as the
    source; an absolute GGUF source is matched against the path it reports. A
    node whose stage of them is ready (`stages`) holds them too, even before
    its next weights report says so.
    """
    keys = {p.pk: weights_key(p.engine, p.model.source) for ps in profiles.values() for p in ps}
    where, reported = weights_on_disk(set(keys.values()))
    staged = stages.ready_on if stages is not None else lambda _key: frozenset()
    return {pk: where.get(key, frozenset()) | staged(key) for pk, key in keys.items()}, reported


def weights_on_disk(keys: set[str]) -> tuple[dict[str, frozenset[str]], dict[str, ReportedWeights]]:
    """Per weights key, the nodes holding those weights on disk, and what the newest report of each source's
    headers says (catalog.sizing). One query; shared by placement and the planner (reconciler.planner.what_if)."""
    where: dict[str, set[str]] = defaultdict(set)
    newest: dict[str, tuple[Any, str]] = {}
    rows = (
        Weights.objects.filter(Q(source__in=keys) | Q(path__in=keys))
        .order_by("seen_at", "pk")
        .values_list("source", "path", "node__name", "header")
    )
    for source, path, node_name, header in rows:
        where[source].add(node_name)
        where[path].add(node_name)
        if header is not None:
            newest[source] = (header, node_name)  # rows come oldest first: the newest report stays
    reported = {source: reported_from_row(header, node) for source, (header, node) in newest.items()}
    return {key: frozenset(nodes) for key, nodes in where.items()}, {s: r for s, r in reported.items() if r}


def _place_one(
    replica: Replica, profile: Profile, capacity: CapacitySnapshot, holders: frozenset[str], memory: MemoryCheck
) -> list[_NewShard] | Unplaceable:
    """Choose GPUs and ports for one replica on `profile` and take them from the snapshot, or say why not.
    Only nodes whose GPUs can hold the profile are candidates (DESIGN "Placement's memory check")."""
    gpu_class = profile.gpu_class
    shape = Shape.of(profile)
    records = memory.records(capacity, profile)
    if not records:
        return Unplaceable(capacity.without_class(gpu_class))
    result: Placement | Unplaceable | None = None
    if shape.nodes_per_replica == 1 and len(records) == capacity.count(gpu_class):
        # Every node of the class may hold it: the snapshot's index finds what `place` would (tests/test_best_fit).
        best = capacity.best_fit(gpu_class, shape.gpus_per_node, holders)
        if best is not None:
            result = on_node(best, shape.gpus_per_node)
    if result is None:
        result = place(records, shape, holders)  # multi-node, a memory filter, or none fits: why not, in words
    if isinstance(result, Unplaceable):
        return result
    assert isinstance(result, Placement)
    port_range = settings.LLMGW_ENGINE_PORT_RANGE
    # The head of a replica spanning nodes takes its rendezvous port too, the one after its own.
    spans = [2 if rank == 0 and len(result.shards) > 1 else 1 for rank in range(len(result.shards))]
    ports: list[int] = []
    # Ports chosen for this replica's earlier shards: nodes sharing an address share one port space.
    chosen: dict[str, set[int]] = defaultdict(set)
    for shard_place, span in zip(result.shards, spans, strict=True):
        address = capacity.node(gpu_class, shard_place.node).address
        port = pick_port(capacity.ports[address] | chosen[address], port_range, span)
        if port is None:
            return Unplaceable(f"no free engine port on {shard_place.node} in {port_range[0]}-{port_range[1]}")
        chosen[address].update(range(port, port + span))
        ports.append(port)
    shards: list[_NewShard] = []
    for rank, (shard_place, port) in enumerate(zip(result.shards, ports, strict=True)):
        node = capacity.node(gpu_class, shard_place.node)
        gpu_ids = capacity.take(gpu_class, shard_place.node, shard_place.gpu_indices, port, spans[rank])
        row = Shard(replica=replica, node_id=node.node_id, rank=rank, port=port, state=ShardState.ASSIGNED)
        shards.append(_NewShard(row, node.name, node.address, gpu_ids, shard_place.gpu_indices))
    return shards


def resend_starts(now: datetime, outbox: Outbox) -> int:
    """Send start_shard again for shards that have not answered (the agent treats a repeat as idempotent).

    The backstop behind acknowledgements: a start still pending is re-sent by
    reconciler.commands within about a second; this covers a start the agent
    acknowledged and then lost (it restarted before the engine began), after
    LLMGW_START_RESEND_SECONDS or at once when its `hello` shows it missing.
    A rank above 0 is due only once its head's engine has started (`lifecycle.head_started`).
    """
    pending = PendingCommand.objects.filter(node_name=OuterRef("node__name"), shard_id=OuterRef("pk"), subject="")
    due = list(
        Shard.objects.filter(
            ~Exists(pending),
            head_started(),
            state=ShardState.ASSIGNED,
            replica__state=ReplicaState.STARTING,
            updated_at__lt=now - timedelta(seconds=settings.LLMGW_START_RESEND_SECONDS),
        ).select_related("replica__model", "replica__profile", "node")
    )
    if not due:
        return 0
    send_starts(due, outbox)
    Shard.objects.filter(pk__in=[s.pk for s in due]).update(updated_at=now)
    return len(due)
