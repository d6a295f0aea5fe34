"""Putting pending replicas on GPUs, and (re)sending the start commands that follow.

The placer (`placement.place`) decides on a capacity snapshot in memory; this
module reads the rows once, writes shards and GPU assignments in bulk, and
queues one start_shard per shard in the tick's Outbox. A unique constraint on
GPUAssignment.gpu backs the arithmetic (DESIGN invariant 2).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings

from .capacity import CapacitySnapshot, free_capacity
from .choices import ReplicaState, ShardState
from .lifecycle import start_fields
from .models import GPUAssignment, Replica, Shard
from .outbox import Outbox
from .placement import Placement, Shape, Unplaceable, pick_port, place


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
    unplaceable: int = 0
    starts_sent: int = 0


def place_pending(now: datetime, epoch: int, outbox: Outbox) -> PlacingOutcome:
    """Place PENDING replicas in profile order, then priority, then age; bulk-write shards and GPU assignments."""
    outcome = PlacingOutcome()
    pending = list(
        Replica.objects.filter(state=ReplicaState.PENDING, model__enabled=True)
        .select_related("model", "profile")
        .order_by("profile__order", "-profile__priority", "created_at", "id")
    )
    if not pending:
        return outcome
    capacity = free_capacity(now)

    placed: list[tuple[Replica, list[_NewShard]]] = []
    unplaceable: list[Replica] = []
    for replica in pending:
        result = _place_one(replica, capacity)
        if isinstance(result, Unplaceable):
            outcome.unplaceable += 1
            if replica.placement_error != result.reason:
                replica.placement_error = result.reason
                unplaceable.append(replica)
            continue
        placed.append((replica, result))

    if placed:
        new_shards = [new for _, shards in placed for new in shards]
        Shard.objects.bulk_create([new.shard for new in new_shards])
        GPUAssignment.objects.bulk_create(
            [GPUAssignment(gpu_id=gpu_id, shard=new.shard) for new in new_shards for gpu_id in new.gpu_ids]
        )
        # Every placed replica changes the same way: one UPDATE, not one CASE per row. A new
        # incarnation has not been used yet: its last use is unknown until it is ready (invariant 3).
        Replica.objects.filter(pk__in=[replica.pk for replica, _ in placed]).update(
            state=ReplicaState.STARTING,
            started_at=now,
            epoch=epoch,
            placement_error="",
            endpoint_url="",
            ready_at=None,
            last_used=None,
        )
    if unplaceable:
        Replica.objects.bulk_update(unplaceable, ["placement_error"])
    for replica, shards in placed:
        for new in shards:
            outbox.start(new.node_name, **start_fields(new.shard, replica, len(shards), shards[0].address, new.indices))
            outcome.starts_sent += 1
    outcome.placed = len(placed)
    return outcome


def _place_one(replica: Replica, capacity: CapacitySnapshot) -> list[_NewShard] | Unplaceable:
    """Choose GPUs and ports for one replica and take them from the snapshot, or say why not."""
    profile = replica.profile
    gpu_class = profile.gpu_class
    result = place(capacity.records(gpu_class), Shape(gpu_class, profile.gpus_per_node, profile.nodes_per_replica))
    if isinstance(result, Unplaceable):
        return result
    assert isinstance(result, Placement)
    port_range = settings.LLMGW_ENGINE_PORT_RANGE
    ports = []
    for shard in result.shards:
        # A replica has at most one shard per node, so only that host's ports matter.
        port = pick_port(capacity.ports[capacity.node(gpu_class, shard.node).address], port_range)
        if port is None:
            return Unplaceable(f"no free engine port on {shard.node} in {port_range[0]}-{port_range[1]}")
        ports.append(port)
    shards = []
    for rank, (shard_place, port) in enumerate(zip(result.shards, ports, strict=True)):
        node = capacity.node(gpu_class, shard_place.node)
        gpu_ids = capacity.take(gpu_class, shard_place.node, shard_place.gpu_indices, port)
        shard = Shard(replica=replica, node_id=node.node_id, rank=rank, port=port, state=ShardState.ASSIGNED)
        shards.append(_NewShard(shard, node.name, node.address, gpu_ids, shard_place.gpu_indices))
    return shards


def resend_starts(now: datetime, outbox: Outbox) -> int:
    """Send start_shard again for shards that have not answered (the agent treats a repeat as idempotent)."""
    due = list(
        Shard.objects.filter(
            state=ShardState.ASSIGNED,
            replica__state=ReplicaState.STARTING,
            updated_at__lt=now - timedelta(seconds=settings.LLMGW_START_RESEND_SECONDS),
        ).select_related("replica__model", "replica__profile", "node")
    )
    if not due:
        return 0
    replica_ids = {s.replica_id for s in due}
    peers: dict[int, list[Shard]] = defaultdict(list)
    for peer in Shard.objects.filter(replica_id__in=replica_ids).select_related("node"):
        peers[peer.replica_id].append(peer)
    gpus: dict[int, list[int]] = defaultdict(list)
    for shard_id, index in GPUAssignment.objects.filter(shard__in=due).values_list("shard_id", "gpu__index"):
        gpus[shard_id].append(index)
    for shard in due:
        mates = peers[shard.replica_id]
        head = min(mates, key=lambda s: s.rank).node
        fields = start_fields(shard, shard.replica, len(mates), head.address or head.name, gpus[shard.pk])
        outbox.start(shard.node.name, **fields)
    Shard.objects.filter(pk__in=[s.pk for s in due]).update(updated_at=now)
    return len(due)
