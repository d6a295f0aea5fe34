"""READY replicas as eviction sees them (`eviction.Occupant`), read from the rows in a fixed number of queries.

Shared by the tick (eviction) and the cluster summary ("what can I stop"), so
both rank the same replicas the same way.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from django.db.models import Sum

from catalog.models import Profile
from inventory.models import gpu_in_service
from reconciler.choices import ReplicaState
from reconciler.models import GPUAssignment, Replica, Shard
from reconciler.placement.eviction import Occupant


def read_occupants(now: datetime) -> list[Occupant]:
    """Every READY replica with its in-service GPUs per node, idle time and running requests. Three queries."""
    ready = Replica.objects.ready()
    rows = list(
        ready.values_list(
            "id", "model__name", "profile__priority", "profile__gpu_class", "last_used", "ready_at", "profile__pool"
        )
    )
    if not rows:
        return []
    # Filtered by a subquery, not by the ids just read: thousands of query parameters cost more to send than
    # the join costs the database.
    gpus: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for replica_id, node_name, index, health, healthy_since in GPUAssignment.objects.filter(
        shard__replica__in=ready
    ).values_list("shard__replica_id", "shard__node__name", "gpu__index", "gpu__health", "gpu__healthy_since"):
        # An unhealthy GPU is not freed by stopping its holder: it stays out of service (DESIGN invariant 5).
        if gpu_in_service(health, healthy_since, now):
            gpus[replica_id][node_name].append(index)
    running = dict(
        Shard.objects.filter(replica__in=ready, running__isnull=False)
        .values("replica_id")
        .annotate(total=Sum("running"))
        .values_list("replica_id", "total")
    )
    occupants = []
    for replica_id, model, priority, gpu_class, last_used, ready_at, pool in rows:
        occupants.append(
            Occupant(
                replica_id=replica_id,
                model=model,
                priority=priority,
                idle_seconds=None if last_used is None else max(0.0, (now - last_used).total_seconds()),
                ready_seconds=max(0.0, (now - ready_at).total_seconds()) if ready_at else 0.0,
                gpu_class=gpu_class,
                gpus={node: tuple(sorted(indices)) for node, indices in gpus[replica_id].items()},
                running=running.get(replica_id),
                pool=pool,
            )
        )
    return occupants


def spare_replicas() -> dict[str, int]:
    """Per model name, how many serving replicas (ready or starting) it has above its min replicas. Two queries.

    The min is the model's first profile's. Pending and failed replicas do not
    count: a model must not lose a serving replica on the strength of one that may never start.
    """
    minimum: dict[str, int] = {}
    for name, min_replicas in Profile.objects.order_by("model_id", "order", "id").values_list(
        "model__name", "min_replicas"
    ):
        minimum.setdefault(name, min_replicas)
    wanted: dict[str, int] = defaultdict(int)
    for (name,) in Replica.objects.filter(state__in=(ReplicaState.READY, ReplicaState.STARTING)).values_list(
        "model__name"
    ):
        wanted[name] += 1
    return {name: max(0, count - minimum.get(name, 0)) for name, count in wanted.items()}


def sleep_levels(replica_ids: list[int]) -> dict[int, int]:
    """The level each replica's engine was started able to sleep at (0: it cannot; it is stopped). One query."""
    rows = Replica.objects.filter(pk__in=replica_ids).values_list("pk", "sleep_level")
    return {pk: level or 0 for pk, level in rows}
