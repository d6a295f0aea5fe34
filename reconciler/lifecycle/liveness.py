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
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import BooleanField, ExpressionWrapper, Q

from inventory.choices import NodeState
from inventory.models import Node
from reconciler.choices import ReplicaState, ShardState
from reconciler.leadership.lease import Leadership
from reconciler.lifecycle.transitions import fail_replicas
from reconciler.models import Shard
from reconciler.outbox import Outbox

log = logging.getLogger(__name__)


@dataclass
class LivenessOutcome:
    """What the tick concluded from silence."""

    unreachable: int = 0
    lost: int = 0
    replicas_failed: int = 0
    brake: bool = False
    stuck: dict[str, set[int]] = field(default_factory=dict)
    """Replicas stuck on the way (`fail_slow_starts`) by state, read with the shards on lost nodes: one query."""


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
    lost_after = now - timedelta(seconds=settings.LLMGW_LOST_AFTER_SECONDS)
    # One read of the silent nodes; a write only for those whose state changes (none, most ticks).
    unreachable_after = now - window
    quiet = Node.objects.filter(
        Q(last_seen__isnull=True) | Q(last_seen__lt=max(unreachable_after, lost_after)),
        state__in=[NodeState.READY, NodeState.UNREACHABLE],
    )
    going, lost_ids = [], []
    for node_id, state, last_seen in quiet.values_list("id", "state", "last_seen"):
        if state == NodeState.READY and (last_seen is None or last_seen < unreachable_after):
            going.append(node_id)
        if last_seen is None or last_seen < lost_after:
            lost_ids.append(node_id)
    if going:
        # The silence again in the write: a heartbeat between the read and here keeps its node READY.
        outcome.unreachable = Node.objects.filter(silent, pk__in=going, state=NodeState.READY).update(
            state=NodeState.UNREACHABLE
        )
    if lost_ids and leadership.leader_since is not None and now - leadership.leader_since >= window:
        # (A new leader has not watched heartbeats for a whole window: the silence
        # it sees may be its own, DESIGN invariant 1.)
        outcome.lost, outcome.brake = _declare_lost(now, lost_ids)
    # One read for both kinds of shard the tick fails: on a lost node (here), or stuck on the way (slow starts).
    stuck = _stuck(now)
    rows = (
        Shard.objects.filter(Q(node__state=NodeState.LOST) | stuck)
        .annotate(is_stuck=ExpressionWrapper(stuck, output_field=BooleanField()))
        .values_list("replica_id", "node_id", "node__state", "replica__state", "is_stuck")
    )
    replica_ids: set[int] = set()
    dead_node_ids: set[int] = set()
    for replica_id, node_id, node_state, replica_state, is_stuck in rows:
        if node_state == NodeState.LOST:
            replica_ids.add(replica_id)
            dead_node_ids.add(node_id)
        elif is_stuck:
            outcome.stuck.setdefault(replica_state, set()).add(replica_id)
    for ids in outcome.stuck.values():
        ids -= replica_ids  # failed here already, as their node's
    outcome.replicas_failed = fail_replicas(
        replica_ids, "node lost: no heartbeat", now, outbox, node_fault=True, dead_node_ids=dead_node_ids
    )
    return outcome


def _declare_lost(now: datetime, lost_ids: list[int]) -> tuple[int, bool]:
    """Mark the nodes `lost_ids` (silent past LLMGW_LOST_AFTER_SECONDS) as LOST, unless the partition brake holds.

    Returns (nodes declared lost, whether the brake held).
    """
    lost = Q(last_seen__isnull=True) | Q(last_seen__lt=now - timedelta(seconds=settings.LLMGW_LOST_AFTER_SECONDS))
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
    watched = [NodeState.READY, NodeState.UNREACHABLE]
    return Node.objects.filter(lost, pk__in=lost_ids, state__in=watched).update(state=NodeState.LOST), False


def _stuck(now: datetime) -> Q:
    """Shards of replicas stuck on the way: STARTING ones not ready within the start timeout, WAKING ones not
    awake within it, and sleepers whose engine has not gone to sleep within the drain timeout and the start
    timeout (their GPUs would stay held for nothing)."""
    timeout = settings.LLMGW_SHARD_START_TIMEOUT_SECONDS
    started_before = now - timedelta(seconds=timeout)
    asleep_before = started_before - timedelta(seconds=settings.LLMGW_DRAIN_TIMEOUT_SECONDS)
    return (
        Q(
            state__in=[ShardState.ASSIGNED, ShardState.STARTING],
            replica__state=ReplicaState.STARTING,
            replica__started_at__lt=started_before,
        )
        | Q(state=ShardState.WAKING, replica__state=ReplicaState.WAKING, updated_at__lt=started_before)
        | Q(state=ShardState.FALLING_ASLEEP, replica__state=ReplicaState.SLEEPING, updated_at__lt=asleep_before)
    )


def fail_slow_starts(now: datetime, outbox: Outbox, stuck: dict[str, set[int]]) -> int:
    """Fail the replicas `check_liveness` found stuck on the way (`_stuck`); returns how many failed."""
    timeout = settings.LLMGW_SHARD_START_TIMEOUT_SECONDS
    why: dict[str, str] = {
        ReplicaState.STARTING: f"not ready within {timeout:g} s of placement",
        ReplicaState.WAKING: f"not awake within {timeout:g} s of its wake",
        ReplicaState.SLEEPING: "its engine did not go to sleep in time",
    }
    return sum(fail_replicas(ids, why[state], now, outbox) for state, ids in stuck.items() if ids)


def fleet_settling(now: datetime, leadership: Leadership) -> bool:
    """Whether nodes may still report in: this leader has watched for less than a heartbeat window and
    some enrolled node has not been heard from (new or unreachable). Then "no room" may only mean "not
    yet", so nothing is declared unplaceable. One query, only during the window."""
    window = timedelta(seconds=settings.LLMGW_UNREACHABLE_AFTER_SECONDS)
    if leadership.leader_since is not None and now - leadership.leader_since >= window:
        return False
    return Node.objects.filter(state__in=(NodeState.NEW, NodeState.UNREACHABLE)).exists()
