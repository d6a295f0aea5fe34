"""The hibernate tier (DESIGN "The hibernate tier"): replicas that sleep instead of stopping.

A replica goes READY → SLEEPING → WAKING → READY:

* **to sleep** (`put_to_sleep`): it leaves the endpoint table at once; once
  routers have had the unpublish grace to see it gone, its head's agent
  gets sleep_shard (`send_sleeps`), which waits for the engine's requests in
  flight to finish, as a drain does, and puts it to sleep. Until the agent
  reports it asleep, its GPUs are still its own (their assignments stay
  awake) and count as being freed (`room`);
* **asleep** (`record_asleep`): every shard's GPU assignments turn asleep. Its
  engines and ports are kept; its GPUs are free for another replica, and
  several sleepers may stack on one GPU, but at most one shard per GPU is
  awake (DESIGN invariant 2, a partial unique index);
* **waking** (`wake_replicas`): its assignments turn awake first — in the same
  transaction that decides the wake, so the database refuses a wake onto a GPU
  another shard holds awake — then the head's agent gets wake_shard; the
  agent's `ready` report (`record_awake`) publishes it again.

Commands go to the head only: vLLM and SGLang sleep and wake every rank of a
replica spanning nodes through the head's HTTP server; the other ranks'
shards follow the head's state.

Which level a replica sleeps at is decided when it is placed, because its
engine must be started able to sleep (`profile_sleep_level`, kept in
`Replica.sleep_level`; empty: it is stopped instead, as before): the
profile's own setting, else the best its engine serves — level 1 (weights kept in host memory, the fastest
wake) when the weights' size is known, so the host memory it holds can be
accounted; else level 2 (weights discarded, reloaded from disk on wake).
An engine that cannot sleep (llama.cpp) is stopped instead, as before.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Exists, OuterRef, Q

from catalog.choices import ENGINE_SLEEP_LEVELS, SleepLevel
from catalog.models import Profile
from catalog.sizing import profile_memory
from reconciler.choices import AWAKE_STATES, ReplicaState, ShardState
from reconciler.demand.idle import Idle
from reconciler.hibernate.host_memory import choose_levels
from reconciler.lifecycle.replica_rows import ReplicaRow
from reconciler.lifecycle.transitions import (
    StopRequest,
    learn_time,
    notify_when_unpublished,
    stop_replicas,
    unpublish_grace_seconds,
)
from reconciler.models import GPUAssignment, Replica, Shard
from reconciler.outbox import Outbox

log = logging.getLogger(__name__)


def sleep_level(engine: str, configured: int | None, weights_bytes: int | None) -> int:
    """The best level a replica of this profile may sleep at; 0 when it cannot sleep (it is stopped instead).

    `configured` is the profile's `sleep_level` (None: the best allowed);
    `weights_bytes` its estimated weights (None: not known, so never level 1,
    whose host memory could not be accounted).
    """
    levels = ENGINE_SLEEP_LEVELS.get(engine, ())
    if configured is not None:
        if configured == SleepLevel.OFFLOAD and weights_bytes is None:
            return SleepLevel.DISCARD if SleepLevel.DISCARD in levels else SleepLevel.NEVER
        return configured if configured in levels else SleepLevel.NEVER
    if SleepLevel.OFFLOAD in levels and weights_bytes is not None:
        return SleepLevel.OFFLOAD
    if SleepLevel.DISCARD in levels:
        return SleepLevel.DISCARD
    return SleepLevel.NEVER


@dataclass(frozen=True)
class SleepRequest:
    """A READY replica to put to sleep, at which level, and why (shown to operators)."""

    replica_id: int
    level: int
    reason: str


def put_to_sleep(requests: Iterable[SleepRequest], now: datetime) -> int:
    """READY replicas become SLEEPING: unpublished now, their heads asked to sleep by a later tick.

    Each sleeps at the best level it was started for that its nodes' host memory
    allows (`host_memory.choose_levels`); one that cannot sleep at all is
    stopped instead, as are level-1 sleepers stopped to make host memory room.
    A constant number of queries. Returns how many were put to sleep.
    """
    wanted = {request.replica_id: request for request in requests}
    if not wanted:
        return 0
    levels, make_room = choose_levels({pk: request.level for pk, request in wanted.items()})
    by_level: dict[int, list[int]] = defaultdict(list)
    stop: list[StopRequest] = []
    for pk, request in wanted.items():
        if levels[pk]:
            by_level[levels[pk]].append(pk)
            log.info("putting replica %s to sleep (level %s): %s", pk, levels[pk], request.reason)
        else:
            stop.append(
                StopRequest(Replica(pk=pk, state=ReplicaState.READY), f"{request.reason}; no host memory to sleep in")
            )
    stop += [
        StopRequest(Replica(pk=pk, state=ReplicaState.SLEEPING), "stopped to free host memory for a newer sleeper")
        for pk in make_room
    ]
    count = 0
    for level, ids in by_level.items():
        count += Replica.objects.filter(pk__in=ids, state=ReplicaState.READY).update(
            state=ReplicaState.SLEEPING, endpoint_url="", sleeping_since=now, sleeping_level=level
        )
    if stop:
        stop_replicas(stop, now)
    if count:
        notify_when_unpublished()
    return count


def send_sleeps(now: datetime, outbox: Outbox) -> int:
    """Send sleep_shard to the heads of SLEEPING replicas unpublished long enough, once; returns how many.

    Like a drain (`lifecycle.stop_shards`): routers must have the table without
    the replica before its engine is asked to finish what it holds and sleep.
    A sleep not acknowledged is sent again by reconciler.commands. One query, plus one update when any is due.
    """
    unpublished_before = now - timedelta(seconds=unpublish_grace_seconds())
    due = list(
        Shard.objects.filter(
            replica__state=ReplicaState.SLEEPING,
            replica__sleeping_since__lte=unpublished_before,
            rank=0,
            state=ShardState.READY,
        ).values_list("id", "node__name", "replica__sleeping_level")
    )
    for shard_id, node_name, level in due:
        outbox.sleep(node_name, shard_id, level or SleepLevel.DISCARD, settings.LLMGW_DRAIN_TIMEOUT_SECONDS)
    if due:
        Shard.objects.filter(pk__in=[shard_id for shard_id, _, _ in due]).update(
            state=ShardState.FALLING_ASLEEP, updated_at=now
        )
    return len(due)


def record_asleep(replica: Replica) -> bool:
    """The head of a SLEEPING replica reports its engine asleep: every shard of it sleeps, its GPUs are free.

    Returns whether anything changed (a late or repeated report changes nothing).
    """
    if replica.state != ReplicaState.SLEEPING:
        return False
    shards = Shard.objects.filter(replica_id=replica.pk)
    changed = shards.exclude(state=ShardState.SLEEPING).update(state=ShardState.SLEEPING)
    GPUAssignment.objects.filter(shard__replica_id=replica.pk, awake=True).update(awake=False)
    if changed:
        log.info("replica %s of %s is asleep", replica.pk, replica.model_id)
    return bool(changed)


def record_awake(replica: Replica, now: datetime) -> bool:
    """The head of a WAKING replica reports it ready: every shard is ready and it is published again.

    Its residency starts afresh (`ready_at`), so it is not swapped out before it has served a while.
    """
    if replica.state != ReplicaState.WAKING:
        return False
    peers = list(Shard.objects.filter(replica_id=replica.pk).select_related("node").order_by("rank"))
    Shard.objects.filter(replica_id=replica.pk).update(state=ShardState.READY, message="")
    head = peers[0]
    # The head's row last changed when its wake was sent: routers' Retry-After for the next swap learns from it.
    learn_time(replica.profile_id, "wake_seconds", (now - head.updated_at).total_seconds())
    replica.state = ReplicaState.READY
    replica.ready_at = now
    replica.sleeping_since = replica.sleeping_level = None  # its host memory is free again
    replica.endpoint_url = f"http://{head.node.effective_address or head.node.name}:{head.port}"
    replica.save(update_fields=["state", "ready_at", "sleeping_since", "sleeping_level", "endpoint_url"])
    log.info("replica %s is awake", replica.pk)
    return True


def sleep_report(shard: Shard, state: str, now: datetime) -> bool | None:
    """What an agent's report about `shard` means for the hibernate tier: whether to wake the ticker, or None
    when the report is not about a sleep or a wake (the caller applies it as a start's)."""
    replica = shard.replica
    if state == "sleeping":
        # Only the head's report counts: its engine sleeps for every rank.
        return shard.rank == 0 and record_asleep(replica)
    if replica.state == ReplicaState.SLEEPING:
        return False  # "ready" from an engine not yet asleep (a hello before the sleep ran): still going to sleep
    if replica.state == ReplicaState.WAKING:
        return state == "ready" and shard.rank == 0 and record_awake(replica, now)
    return None


def asleep_replicas() -> Q:
    """SLEEPING replicas whose engines have all gone to sleep (their GPUs free for others)."""
    not_yet = Shard.objects.exclude(state=ShardState.SLEEPING).filter(replica=OuterRef("pk"))
    return Q(state=ReplicaState.SLEEPING) & ~Q(Exists(not_yet))


def wake_replicas(replica_ids: Iterable[int], now: datetime, outbox: Outbox) -> int:
    """Wake asleep replicas: their GPU assignments turn awake, their heads get wake_shard. Returns how many.

    The caller has checked that no other shard is awake on their GPUs; the
    database checks it again (invariant 2), so a race with a placement fails
    the transaction instead of putting two awake engines on one GPU.
    """
    ids = list(Replica.objects.filter(asleep_replicas(), pk__in=list(replica_ids)).values_list("pk", flat=True))
    if not ids:
        return 0
    GPUAssignment.objects.filter(shard__replica_id__in=ids).update(awake=True)
    Replica.objects.filter(pk__in=ids).update(state=ReplicaState.WAKING, wanted_since=None)
    heads = Shard.objects.filter(replica_id__in=ids, rank=0).values_list("id", "node__name")
    for shard_id, node_name in heads:
        outbox.wake(node_name, shard_id)
    Shard.objects.filter(replica_id__in=ids).update(state=ShardState.WAKING, updated_at=now)
    log.info("waking replicas %s", sorted(ids))
    return len(ids)


def profile_sleep_level(profile: Profile) -> int:
    """`sleep_level` for a profile row, its weights judged by the memory model (catalog.sizing, cached per source)."""
    try:
        weights = profile_memory(profile).weights.bytes
    except ValueError:
        weights = None
    return sleep_level(profile.engine, profile.sleep_level, weights)


def idle_sleepers(
    profiles: list[Profile], wanted: list[ReplicaRow], busy: set[int], now: datetime
) -> list[SleepRequest]:
    """One model's READY replicas above its min whose profile sleeps after a known idle time that has passed,
    longest idle first. `profiles` are the model's in order (the first sets min); `busy` replicas report
    running requests. Only while usage is known (the caller's rule, DESIGN invariant 3)."""
    awake = [r for r in wanted if r.state in AWAKE_STATES]
    spare = len(awake) - profiles[0].min_replicas
    if spare <= 0:
        return []
    by_pk = {p.pk: p for p in profiles}
    found = []
    for replica in awake:
        profile = by_pk[replica.profile_id]
        after = profile.sleep_after_seconds
        if replica.state != ReplicaState.READY or replica.pk in busy or after is None:
            continue
        since = Idle.since(replica.last_used, now)
        if since.seconds is None or since.seconds < after:
            continue
        if replica.sleep_level:
            found.append((since.seconds, replica.pk, replica.sleep_level, after))
    found.sort(key=lambda item: -item[0])
    return [
        SleepRequest(pk, level, f"idle for {Idle(seconds)} (sleeps after {Idle(after)})")
        for seconds, pk, level, after in found[:spare]
    ]
