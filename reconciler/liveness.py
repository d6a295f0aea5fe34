"""Node liveness and stuck starts: what the tick concludes from silence.

A READY node silent for LLMGW_UNREACHABLE_AFTER_SECONDS becomes UNREACHABLE
(its replicas leave the endpoint table); silent for LLMGW_LOST_AFTER_SECONDS it
is LOST and its replicas fail, to be placed elsewhere. A new leader declares
nothing lost until it has watched heartbeats for a whole window (DESIGN
invariant 1). A replica not ready within LLMGW_SHARD_START_TIMEOUT_SECONDS of
placement fails.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Q

from inventory.choices import NodeState
from inventory.models import Node

from .choices import ReplicaState, ShardState
from .lease import Leadership
from .lifecycle import fail_replicas
from .models import Shard
from .outbox import Outbox


def check_liveness(now: datetime, leadership: Leadership, outbox: Outbox) -> tuple[int, int, int]:
    """READY → UNREACHABLE after a silence; → LOST after a longer one, failing the replicas it held.

    Returns (nodes now unreachable, nodes now lost, replicas failed).
    """
    window = timedelta(seconds=settings.LLMGW_UNREACHABLE_AFTER_SECONDS)
    silent = Q(last_seen__isnull=True) | Q(last_seen__lt=now - window)
    unreachable = Node.objects.filter(silent, state=NodeState.READY).update(state=NodeState.UNREACHABLE)
    if leadership.leader_since is None or now - leadership.leader_since < window:
        # A new leader has not watched heartbeats for a whole window: the
        # silence it sees may be its own (DESIGN invariant 1).
        return unreachable, 0, 0
    lost = Q(last_seen__isnull=True) | Q(last_seen__lt=now - timedelta(seconds=settings.LLMGW_LOST_AFTER_SECONDS))
    lost_ids = list(
        Node.objects.filter(lost, state__in=[NodeState.READY, NodeState.UNREACHABLE]).values_list("id", flat=True)
    )
    if not lost_ids:
        return unreachable, 0, 0
    nodes_lost = Node.objects.filter(pk__in=lost_ids).update(state=NodeState.LOST)
    replica_ids = set(Shard.objects.filter(node_id__in=lost_ids).values_list("replica_id", flat=True))
    failed = fail_replicas(
        replica_ids, "node lost: no heartbeat", now, outbox, node_fault=True, dead_node_ids=set(lost_ids)
    )
    return unreachable, nodes_lost, failed


def fail_slow_starts(now: datetime, outbox: Outbox) -> int:
    """Fail STARTING replicas not ready within the start timeout; returns how many failed."""
    timeout = settings.LLMGW_SHARD_START_TIMEOUT_SECONDS
    replica_ids = set(
        Shard.objects.filter(
            state__in=[ShardState.ASSIGNED, ShardState.STARTING],
            replica__state=ReplicaState.STARTING,
            replica__started_at__lt=now - timedelta(seconds=timeout),
        ).values_list("replica_id", flat=True)
    )
    return fail_replicas(replica_ids, f"not ready within {timeout:g} s of placement", now, outbox)
