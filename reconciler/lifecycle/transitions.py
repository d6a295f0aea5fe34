"""Replica state changes shared by the tick, agent reports and admin actions.

A replica goes PENDING → STARTING (placed) → READY (every shard ready) and
leaves through STOPPING (a drain: shards stopped, then the row deleted) or
FAILED (shards dropped, retried as PENDING after an exponential backoff).
Every function here runs inside its caller's transaction; commands go into
the caller's Outbox.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Case, Exists, F, FloatField, OuterRef, Q, Value, When
from django.utils import timezone
from msgspec import UNSET

from catalog.engine_flags import with_batch, with_context
from catalog.models import Profile
from nodewire.parts import AdapterSlots
from nodewire.protocol import StartShard
from reconciler.choices import ReplicaState, ShardState
from reconciler.lifecycle.replica_rows import ReplicaRow
from reconciler.models import GPUAssignment, Replica, Shard
from reconciler.outbox import UNSTAMPED, Outbox
from reconciler.placement.search import rendezvous_port
from reconciler.signals import work_pending

log = logging.getLogger(__name__)


def backoff_seconds(failure_count: int) -> float:
    """Delay before retrying a replica that has failed `failure_count` times (exponential, capped)."""
    base, cap = settings.LLMGW_BACKOFF_BASE_SECONDS, settings.LLMGW_BACKOFF_MAX_SECONDS
    exponent = min(max(failure_count - 1, 0), 62)  # past the cap anyway; keeps the float finite
    return min(base * 2.0**exponent, cap)


def notify_work_pending() -> None:
    """After commit, tell whoever runs ticks that the next one has work (the embedded runner ticks at once)."""
    transaction.on_commit(lambda: work_pending.send(sender=None))


def unpublish_grace_seconds() -> float:
    """How long a replica leaving service (stopping, going to sleep) stays unpublished before its engine is
    asked to drain or sleep. Routers receive a new table at once (pushed, in milliseconds), so this only has
    to cover a request a router picked just before applying it: LLMGW_UNPUBLISH_GRACE_SECONDS."""
    return float(settings.LLMGW_UNPUBLISH_GRACE_SECONDS)


def notify_work_due(seconds: float) -> None:
    """After commit, tell whoever runs ticks that work falls due in `seconds` (an unpublish grace ending, an
    occupant becoming evictable), so it is done then rather than up to a tick interval later (the embedded
    runner ticks at once). Nothing when the next regular tick comes first: that tick looks again."""
    if seconds >= settings.LLMGW_TICK_SECONDS:
        return

    def later() -> None:
        timer = threading.Timer(max(0.0, seconds), work_pending.send, kwargs={"sender": None})
        timer.daemon = True
        timer.start()

    transaction.on_commit(later)


def notify_when_unpublished() -> None:
    """After commit, tell whoever runs ticks once the unpublish grace has passed: the drain or sleep it delays."""
    notify_work_due(unpublish_grace_seconds())


_FAILED_FIELDS = (
    "state", "failure_count", "next_attempt_at", "last_error", "endpoint_url", "ready_at", "last_used", "wanted_since",
)  # fmt: skip
"""What taking a replica out of service changes (`fail_replicas`)."""


def fail_replicas(
    replica_ids,
    message: str,
    now: datetime,
    outbox: Outbox,
    *,
    node_fault: bool = False,
    silent_shard_ids=(),
    dead_node_ids=(),
) -> int:
    """Take replicas out of service: drop their shards and GPUs, stop their surviving engines.

    A replica's own failure (its engine crashed, never became ready) makes it
    FAILED with an exponential backoff. A failure of its node (node lost, agent
    gone or restarted, a port busy on the node) is not the replica's: it goes
    straight back to PENDING, without backoff, to be placed again (elsewhere when
    the node cannot take it). STOPPING replicas are deleted: they were going away.
    `silent_shard_ids` and shards on `dead_node_ids` get no stop_shard (their
    engine is already gone). Returns how many replicas were taken out of service.
    """
    replica_ids = set(replica_ids)
    if not replica_ids:
        return 0
    # Locked in key order, so concurrent reports about one replica count its failures one after the other.
    replicas = list(Replica.objects.select_for_update().filter(pk__in=replica_ids).order_by("pk"))
    shards = Shard.objects.filter(replica_id__in=replica_ids).values_list("id", "node_id", "node__name", "state")
    for shard_id, node_id, node_name, state in shards:
        if shard_id not in silent_shard_ids and node_id not in dead_node_ids and state != ShardState.STOPPED:
            outbox.stop(node_name, shard_id)
    failed = [r for r in replicas if r.state != ReplicaState.STOPPING]
    for replica in failed:
        replica.last_error = message
        replica.endpoint_url = ""
        replica.ready_at = None
        # The next incarnation's last use is its own (DESIGN invariant 3), and so is its wait for room.
        replica.last_used = None
        replica.wanted_since = None
        if node_fault:
            replica.state, replica.next_attempt_at = ReplicaState.PENDING, None
        else:
            replica.state = ReplicaState.FAILED
            replica.failure_count += 1
            replica.next_attempt_at = now + timedelta(seconds=backoff_seconds(replica.failure_count))
    if failed:
        Replica.objects.bulk_update(failed, _FAILED_FIELDS)
    Shard.objects.filter(replica_id__in=replica_ids).delete()
    going = [r.pk for r in replicas if r.state == ReplicaState.STOPPING]
    if going:
        Replica.objects.filter(pk__in=going).delete()
    if failed:
        log.warning(
            "replicas %s %s: %s",
            sorted(r.pk for r in failed),
            "lost their node, placing again" if node_fault else "failed",
            message,
        )
    return len(failed)


def forgive_stable(now: datetime) -> int:
    """Backoff that forgets: a replica ready for LLMGW_BACKOFF_RESET_SECONDS starts its failure count afresh."""
    stable_since = now - timedelta(seconds=settings.LLMGW_BACKOFF_RESET_SECONDS)
    return Replica.objects.filter(state=ReplicaState.READY, failure_count__gt=0, ready_at__lte=stable_since).update(
        failure_count=0
    )


def retry_failed(now: datetime) -> int:
    """FAILED replicas whose backoff has passed become PENDING again; returns how many."""
    return (
        Replica.objects.filter(state=ReplicaState.FAILED)
        .filter(Q(next_attempt_at__lte=now) | Q(next_attempt_at__isnull=True))
        .update(state=ReplicaState.PENDING)
    )


@dataclass(frozen=True)
class StopRequest:
    """A replica to stop, and why (shown to operators)."""

    replica: Replica | ReplicaRow  # only its pk and state are read
    reason: str


def stop_replicas(requests: Iterable[StopRequest], now: datetime) -> tuple[int, int]:
    """Stop replicas: those without shards are deleted at once, the rest become STOPPING.

    A STOPPING replica is out of the endpoint table at once; the leader's next
    tick, once routers have had the unpublish grace (`unpublish_grace_seconds`) to see it gone, sends
    its shards drain_shard (`stop_shards`). Returns (deleted, stopping).
    """
    why = {r.replica.pk: r.reason for r in requests if r.replica.state != ReplicaState.STOPPING}
    if not why:
        return 0, 0
    with_shards = set(Shard.objects.filter(replica_id__in=why).values_list("replica_id", flat=True))
    idle = why.keys() - with_shards
    if idle:
        Replica.objects.filter(pk__in=idle).delete()
    if with_shards:
        stopping = [
            Replica(pk=pk, state=ReplicaState.STOPPING, endpoint_url="", stopping_since=now, stop_reason=why[pk][:200])
            for pk in sorted(with_shards)
        ]
        Replica.objects.bulk_update(stopping, ["state", "endpoint_url", "stopping_since", "stop_reason"])
        log.info("stopping replicas: %s", "; ".join(f"{pk} ({why[pk]})" for pk in sorted(with_shards)))
        notify_when_unpublished()
    return len(idle), len(with_shards)


def stop_replica(replica: Replica, reason: str = "stopped by an operator") -> None:
    """Stop one replica (admin action), in one transaction: see `stop_replicas`."""
    with transaction.atomic():
        current = Replica.objects.select_for_update().filter(pk=replica.pk).first()
        if current is None:
            return
        stop_replicas([StopRequest(current, reason)], timezone.now())
        notify_work_pending()


def stopping_or_sleeping() -> bool:
    """Whether any replica is stopping or sleeping: else neither `stop_shards` nor `hibernate.send_sleeps` has
    anything to do. One query."""
    return Replica.objects.filter(state__in=(ReplicaState.STOPPING, ReplicaState.SLEEPING)).exists()


def stop_shards(now: datetime, outbox: Outbox) -> tuple[int, int]:
    """Send drain_shard to STOPPING replicas' shards, once; delete replicas with none left.

    A replica spanning nodes drains its head first and the other ranks once
    the head has stopped (`head_gone`): they serve no requests of their own,
    but every request in flight on the head runs through them.

    Once: a drain not acknowledged is sent again by reconciler.commands, and
    one acknowledged is under way on the agent until the engine stops (its
    report deletes the shard) or the agent restarts (its hello does).

    A replica that became STOPPING less than the unpublish grace ago waits
    for the next tick: routers must have the table without it before its
    engine is asked to finish (DESIGN "Stopping is always a drain").
    Returns (drains sent, replicas deleted).
    """
    unpublished_before = now - timedelta(seconds=unpublish_grace_seconds())
    due = list(
        Shard.objects.filter(replica__state=ReplicaState.STOPPING)
        .filter(Q(replica__stopping_since__isnull=True) | Q(replica__stopping_since__lte=unpublished_before))
        .filter(head_gone())
        .exclude(state__in=[ShardState.STOPPED, ShardState.STOPPING])
        .values_list("id", "node__name")
    )
    for shard_id, node_name in due:
        outbox.drain(node_name, shard_id, settings.LLMGW_DRAIN_TIMEOUT_SECONDS)
    if due:
        Shard.objects.filter(pk__in=[shard_id for shard_id, _ in due]).update(state=ShardState.STOPPING, updated_at=now)
    empty = Replica.objects.filter(~Exists(Shard.objects.filter(replica=OuterRef("pk"))), state=ReplicaState.STOPPING)
    _, deleted = empty.delete()
    return len(due), deleted.get(Replica._meta.label, 0)


def start_command(
    shard: Shard,
    replica: Replica,
    node_count: int,
    head_address: str,
    gpu_indices: Iterable[int],
    host: str = "",
    head_port: int = 0,
) -> StartShard:
    """The start_shard for one shard, unstamped (the outbox stamps the epoch and command id when it sends).

    `host` is the address of the shard's node that its endpoint is published on;
    the engine listens there only ("" lets the agent use its own --address).
    `head_port` is the engine port of rank 0, beside which a replica spanning
    nodes has its rendezvous port.
    """
    profile = replica.profile
    slots = profile.max_adapters
    return StartShard(
        epoch=UNSTAMPED,
        shard_id=shard.pk,
        replica_id=replica.pk,
        rank=shard.rank,
        node_count=node_count,
        head_address=head_address,
        engine=profile.engine,
        model=replica.model.name,
        source=replica.model.source,
        gpu_indices=sorted(gpu_indices),
        port=shard.port,
        # The profile's max_model_len and max_concurrency as the engine's own flags, unless its engine args set them.
        args=with_batch(
            profile.engine,
            with_context(profile.engine, list(profile.engine_args or []), profile.max_model_len),
            profile.max_concurrency,
        ),
        env=dict(profile.env or {}),
        host=host,
        rendezvous_port=rendezvous_port(head_port) if node_count > 1 else 0,
        # Started able to sleep when the placer gave it a sleep level (reconciler.hibernate.tier); left out otherwise,
        # so a start that does not ask for it keeps the shape starts always had.
        sleep_mode=True if replica.sleep_level else UNSET,
        # LoRA on for a profile that takes adapters; left out otherwise, for the same reason.
        adapters=AdapterSlots(slots=slots, max_rank=profile.max_adapter_rank) if slots else UNSET,
    )


def send_starts(shards: list[Shard], outbox: Outbox) -> int:
    """Queue start_shard for each of `shards` (with replica__model, replica__profile and node selected).

    Two queries whatever their number: the shards' replicas' peers (for the
    head's address and port) and their GPUs. Returns how many were queued.
    """
    if not shards:
        return 0
    peers: dict[int, list[Shard]] = defaultdict(list)
    for peer in Shard.objects.filter(replica_id__in={s.replica_id for s in shards}).select_related("node"):
        peers[peer.replica_id].append(peer)
    gpus: dict[int, list[int]] = defaultdict(list)
    for shard_id, index in GPUAssignment.objects.filter(shard__in=shards).values_list("shard_id", "gpu__index"):
        gpus[shard_id].append(index)
    for shard in shards:
        mates = peers[shard.replica_id]
        head = min(mates, key=lambda s: s.rank)
        head_address = head.node.effective_address or head.node.name
        own = shard.node.effective_address or shard.node.name
        outbox.start(
            shard.node.name,
            start_command(shard, shard.replica, len(mates), head_address, gpus[shard.pk], own, head.port),
        )
    return len(shards)


def start_followers(replica_id: int, outbox: Outbox) -> int:
    """Start the ranks above 0 of a replica whose head has just started; returns how many.

    A replica spanning nodes starts its head first: rank 0 hosts the
    rendezvous the other ranks join (agent/engines/launch.py), so they are started
    once its engine runs, never before (DESIGN "Agent protocol").
    """
    followers = Shard.objects.filter(replica_id=replica_id, rank__gt=0, state=ShardState.ASSIGNED)
    return send_starts(list(followers.select_related("replica__model", "replica__profile", "node")), outbox)


def head_gone() -> Q:
    """Shards whose drain is due by the rank order: heads, and ranks whose head has stopped (its row is gone)."""
    return Q(rank=0) | ~Q(Exists(Shard.objects.filter(replica=OuterRef("replica"), rank=0)))


def head_started() -> Q:
    """Shards whose start is due by the rank order: heads, and ranks whose head's engine has started."""
    head_running = Shard.objects.filter(replica=OuterRef("replica"), rank=0).exclude(state=ShardState.ASSIGNED)
    return Q(rank=0) | Q(Exists(head_running))


def mark_ready_if_whole(replica: Replica, now: datetime) -> bool:
    """A STARTING replica whose shards are all ready becomes READY at its head's address; return whether it did."""
    if replica.state != ReplicaState.STARTING:
        return False
    peers = list(Shard.objects.filter(replica_id=replica.pk).select_related("node").order_by("rank"))
    if not all(p.state == ShardState.READY for p in peers):
        return False
    head = peers[0]
    replica.state = ReplicaState.READY
    replica.ready_at = now
    replica.endpoint_url = f"http://{head.node.effective_address or head.node.name}:{head.port}"
    replica.save(update_fields=["state", "ready_at", "endpoint_url"])
    if replica.started_at is not None:
        _learn_start_time(replica.profile_id, (now - replica.started_at).total_seconds())
    return True


def _learn_start_time(profile_id: int, seconds: float) -> None:
    """Fold one start's duration into the profile's estimate (half old, half new), in one UPDATE.

    Routers turn the estimate into Retry-After for clients a cold start turned away.
    """
    learn_time(profile_id, "start_seconds", seconds)


def learn_time(profile_id: int, field: str, seconds: float) -> None:
    """Fold one duration into a profile's learned `field` (start_seconds, wake_seconds): half old, half new."""
    seconds = max(0.0, seconds)
    Profile.objects.filter(pk=profile_id).update(
        **{
            field: Case(
                When(**{f"{field}__isnull": True}, then=Value(seconds)),
                default=(F(field) + Value(seconds)) / Value(2.0),
                output_field=FloatField(),
            )
        }
    )
