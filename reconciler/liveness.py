"""Node liveness and stuck starts: what the tick concludes from silence.

A READY node silent for LLMGW_UNREACHABLE_AFTER_SECONDS becomes UNREACHABLE
(its replicas leave the endpoint table); silent for LLMGW_LOST_AFTER_SECONDS it
is LOST and its replicas fail, to be placed elsewhere. A new leader declares
nothing lost until it has watched heartbeats for a whole window (DESIGN
invariant 1). A replica not ready within LLMGW_SHARD_START_TIMEOUT_SECONDS of
placement fails.

Partition brake: when more than LLMGW_PARTITION_BRAKE_FRACTION of the nodes go
silent together, none is declared lost and nothing is replaced until their
heartbeats return or an operator declares them lost (admin); the status says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
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

log = logging.getLogger(__name__)


@dataclass
class LivenessOutcome:
    """What the tick concluded from silence."""

    unreachable: int = 0
    lost: int = 0
    replicas_failed: int = 0
    brake: bool = False


def partition_brake(silent: int, watched: int) -> bool:
    """Whether so many nodes went silent together that the silence is more likely ours (a partition,
    a switch, the control plane's own network) than theirs: more than LLMGW_PARTITION_BRAKE_FRACTION of
    the nodes being watched, and never for a single node. The tick and the status both ask this."""
    return silent > max(1.0, settings.LLMGW_PARTITION_BRAKE_FRACTION * watched)


def check_liveness(now: datetime, leadership: Leadership, outbox: Outbox) -> LivenessOutcome:
    """READY → UNREACHABLE after a silence; → LOST after a longer one, failing the replicas it held.

    Nothing is declared lost while the partition brake holds; a node an operator
    declared lost (admin) has its replicas placed elsewhere all the same.
    """
    outcome = LivenessOutcome()
    window = timedelta(seconds=settings.LLMGW_UNREACHABLE_AFTER_SECONDS)
    silent = Q(last_seen__isnull=True) | Q(last_seen__lt=now - window)
    outcome.unreachable = Node.objects.filter(silent, state=NodeState.READY).update(state=NodeState.UNREACHABLE)
    if leadership.leader_since is not None and now - leadership.leader_since >= window:
        # (A new leader has not watched heartbeats for a whole window: the silence
        # it sees may be its own, DESIGN invariant 1.)
        outcome.lost, outcome.brake = _declare_lost(now)
    on_lost = Shard.objects.filter(node__state=NodeState.LOST).values_list("replica_id", "node_id")
    replica_ids, dead_node_ids = {r for r, _ in on_lost}, {n for _, n in on_lost}
    outcome.replicas_failed = fail_replicas(
        replica_ids, "node lost: no heartbeat", now, outbox, node_fault=True, dead_node_ids=dead_node_ids
    )
    return outcome


def _declare_lost(now: datetime) -> tuple[int, bool]:
    """Mark nodes silent past LLMGW_LOST_AFTER_SECONDS as LOST, unless the partition brake holds.

    Returns (nodes declared lost, whether the brake held).
    """
    lost = Q(last_seen__isnull=True) | Q(last_seen__lt=now - timedelta(seconds=settings.LLMGW_LOST_AFTER_SECONDS))
    lost_ids = list(
        Node.objects.filter(lost, state__in=[NodeState.READY, NodeState.UNREACHABLE]).values_list("id", flat=True)
    )
    if not lost_ids:
        return 0, False
    states = list(
        Node.objects.filter(state__in=[NodeState.READY, NodeState.UNREACHABLE]).values_list("state", flat=True)
    )
    if partition_brake(states.count(NodeState.UNREACHABLE), len(states)):
        log.warning(
            "partition brake: %d of %d nodes are silent; declaring none lost until heartbeats return "
            "or an operator declares them lost",
            states.count(NodeState.UNREACHABLE),
            len(states),
        )
        return 0, True
    return Node.objects.filter(pk__in=lost_ids).update(state=NodeState.LOST), False


def fail_slow_starts(now: datetime, outbox: Outbox) -> int:
    """Fail replicas stuck on the way: STARTING ones not ready within the start timeout, WAKING ones not awake
    within it, and sleepers whose engine has not gone to sleep within the drain timeout and the start timeout
    (their GPUs would stay held for nothing). One query, plus the failures. Returns how many failed."""
    timeout = settings.LLMGW_SHARD_START_TIMEOUT_SECONDS
    started_before = now - timedelta(seconds=timeout)
    asleep_before = started_before - timedelta(seconds=settings.LLMGW_DRAIN_TIMEOUT_SECONDS)
    stuck = (
        Q(
            state__in=[ShardState.ASSIGNED, ShardState.STARTING],
            replica__state=ReplicaState.STARTING,
            replica__started_at__lt=started_before,
        )
        | Q(state=ShardState.WAKING, replica__state=ReplicaState.WAKING, updated_at__lt=started_before)
        | Q(state=ShardState.FALLING_ASLEEP, replica__state=ReplicaState.SLEEPING, updated_at__lt=asleep_before)
    )
    rows = Shard.objects.filter(stuck).values_list("replica_id", "replica__state")
    failing: dict[str, set[int]] = {}
    for replica_id, state in rows:
        failing.setdefault(state, set()).add(replica_id)
    why = {
        ReplicaState.STARTING: f"not ready within {timeout:g} s of placement",
        ReplicaState.WAKING: f"not awake within {timeout:g} s of its wake",
        ReplicaState.SLEEPING: "its engine did not go to sleep in time",
    }
    return sum(fail_replicas(ids, why[state], now, outbox) for state, ids in failing.items())


def fleet_settling(now: datetime, leadership: Leadership) -> bool:
    """Whether nodes may still report in: this leader has watched for less than a heartbeat window and
    some enrolled node has not been heard from (new or unreachable). Then "no room" may only mean "not
    yet", so nothing is declared unplaceable. One query, only during the window."""
    window = timedelta(seconds=settings.LLMGW_UNREACHABLE_AFTER_SECONDS)
    if leadership.leader_since is not None and now - leadership.leader_since >= window:
        return False
    return Node.objects.filter(state__in=(NodeState.NEW, NodeState.UNREACHABLE)).exists()
