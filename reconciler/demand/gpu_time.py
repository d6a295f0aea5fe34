"""GPU time per replica and hour, counted by the tick: the whole the showback divides between teams (keys.showback).

A replica spends GPU time while its GPUs are its own: from placement (GPUs assigned, `started_at`) through
starting, serving and draining, until its shards are gone; asleep, its GPUs may hold another replica and it spends
none. Each tick adds, per replica, its awake GPUs times the seconds since the replica was last counted
(`Replica.gpu_time_until`) to `keys.GpuHour`, split at hour boundaries. It runs in the fenced transaction: a tick
that loses the lease counts nothing, so two leaders never count the same seconds. A gap longer than
`MAX_GAP_SECONDS` (no tick ran: the control plane was down) counts only that long: nobody watched the replica
then, and billing time nobody saw would charge teams for GPUs that may have been idle or gone.

Every `COUNT_SECONDS`, not every tick (the marks make any cadence exact): four queries whatever the fleet, one
read of the assignments grouped by replica, one upsert per batch of hours, one update of the replicas' marks, and
one to find that no hour waits to be rolled up for the showback (keys.showback.roll_up; two more once an hour).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.db.models import Count, Q

from hub.contracts import HOUR
from keys.showback import add_gpu_time, roll_up
from reconciler.leadership.lease import Leadership
from reconciler.models import GPUAssignment, Replica

COUNT_SECONDS = 30
MAX_GAP_SECONDS = 300  # ten counts missed


def gpu_count_due(leadership: Leadership, now: datetime) -> bool:
    """Whether this tick counts GPU time; a leader's first tick only sets when its first count is (the replicas'
    marks carry what its predecessor counted)."""
    if leadership.next_gpu_count is None:
        leadership.next_gpu_count = now + timedelta(seconds=COUNT_SECONDS)
    return now >= leadership.next_gpu_count


def counted(leadership: Leadership, now: datetime) -> None:
    """The count of the tick at `now` committed: the next one is `COUNT_SECONDS` later."""
    leadership.next_gpu_count = now + timedelta(seconds=COUNT_SECONDS)


def count_gpu_time(now: datetime) -> int:
    """Add each replica's GPU time since it was last counted (or placed) up to `now`; returns the (replica, hour)
    rows added to."""
    replica = ("shard__replica_id", "shard__replica__model__name", "shard__replica__gpu_time_until")
    held = (
        GPUAssignment.objects.values(*replica, "shard__replica__started_at")
        .annotate(gpus=Count("id", filter=Q(awake=True)))
        .values_list(*replica, "shard__replica__started_at", "gpus")
    )
    rows: list[tuple[int, str, int, float]] = []
    replicas = []
    for replica_id, model, until, started, gpus in held:
        replicas.append(replica_id)
        since = max(until or started or now, now - timedelta(seconds=MAX_GAP_SECONDS))
        if gpus and since < now:
            rows.extend((replica_id, model, hour, gpus * seconds) for hour, seconds in hours_between(since, now))
    if rows:
        add_gpu_time(rows)
    if replicas:
        # Asleep too: a replica that wakes is counted from the tick it was last seen, not from before its sleep.
        Replica.objects.filter(pk__in=replicas).update(gpu_time_until=now)
    roll_up(now)  # the hours that ended, divided once for every showback to come
    return len(rows)


def hours_between(start: datetime, end: datetime) -> list[tuple[int, float]]:
    """[start, end) cut at hour boundaries: (the hour's start in Unix seconds, seconds of it)."""
    begin, finish = start.astimezone(UTC).timestamp(), end.astimezone(UTC).timestamp()
    pieces = []
    while begin < finish:
        hour = int(begin // HOUR) * HOUR
        upto = min(finish, hour + HOUR)
        pieces.append((hour, upto - begin))
        begin = upto
    return pieces
