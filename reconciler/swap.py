"""Swaps: wake a sleeping replica for the requests that want it, putting its GPUs' occupant to sleep first.

Runs in the tick after demand, for the models whose requests wait with only
sleepers to serve them (or that fell below min with sleepers). Per model, its
asleep replicas most recently used first:

1. one whose GPUs no other shard holds awake is woken (`hibernate.wake_replicas`);
2. else, when every awake occupant of the best sleeper's GPUs may be evicted
   by the one eviction order (`eviction.stop_candidates`: known idle, not busy,
   resident long enough, not above the waiting model's priority, not below its
   own min), the occupants are put to sleep (or stopped, when their engine
   cannot sleep) — a sleep is a drain, so no request is cut — and the sleeper
   is woken by a later tick, once their engines are asleep;
3. else it waits: the requests are held while routers keep asking.

Occupants already going to sleep or stopping are waited for, never evicted
twice. A constant number of queries whatever the number of models.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime

from django.conf import settings

from .choices import ReplicaState
from .eviction import Holding, stop_candidates
from .hibernate import SleepRequest, asleep_replicas, put_to_sleep, wake_replicas
from .holdings import read_holdings, sleep_levels, spare_replicas
from .lifecycle import StopRequest, stop_replicas
from .models import GPUAssignment, Replica
from .outbox import Outbox

log = logging.getLogger(__name__)


def wake_for_demand(model_ids: Iterable[int], now: datetime, outbox: Outbox) -> tuple[int, int]:
    """Wake a sleeper of each model in `model_ids`, or make room for one; returns (woken, occupants evicted)."""
    model_ids = set(model_ids)
    if not model_ids:
        return 0, 0
    sleepers = list(
        Replica.objects.filter(asleep_replicas(), model_id__in=model_ids)
        .order_by("model_id", "-last_used", "id")
        .values_list("id", "model_id", "model__name", "profile__priority")
    )
    if not sleepers:
        return 0, 0
    gpus: dict[int, set[int]] = defaultdict(set)
    for replica_id, gpu_id in GPUAssignment.objects.filter(shard__replica_id__in=[s[0] for s in sleepers]).values_list(
        "shard__replica_id", "gpu_id"
    ):
        gpus[replica_id].add(gpu_id)
    awake_on: dict[int, tuple[int, str]] = {
        gpu_id: (replica_id, state)
        for gpu_id, replica_id, state in GPUAssignment.objects.filter(
            gpu_id__in={g for held in gpus.values() for g in held}, awake=True
        ).values_list("gpu_id", "shard__replica_id", "shard__replica__state")
    }
    woken: list[int] = []
    taken: set[int] = set()  # GPUs a wake or an eviction of this tick has claimed
    victims: dict[int, tuple[str, int]] = {}  # occupant replica id -> (why, sleep level)
    holdings: list[Holding] | None = None
    spare: dict[str, int] = {}
    levels: dict[int, int] = {}
    by_model: dict[int, list[tuple[int, str, int]]] = defaultdict(list)
    for replica_id, model_id, name, priority in sleepers:
        by_model[model_id].append((replica_id, name, priority))
    for candidates in by_model.values():
        free = [c for c in candidates if not gpus[c[0]] & (taken | awake_on.keys())]
        if free:
            woken.append(free[0][0])
            taken |= gpus[free[0][0]]
            continue
        replica_id, name, priority = candidates[0]
        if gpus[replica_id] & taken:
            continue  # another swap of this tick is using those GPUs
        occupants = {awake_on[g] for g in gpus[replica_id] if g in awake_on}
        serving = {occupant for occupant, state in occupants if state == ReplicaState.READY}
        if not serving:
            continue  # its occupants are already going to sleep or stopping: woken once they are gone
        if holdings is None:
            holdings, spare = read_holdings(now), spare_replicas()
            levels = sleep_levels([h.replica_id for h in holdings])
        evictable = stop_candidates(
            (h for h in holdings if h.model != name and h.replica_id not in victims),
            spare,
            min_idle=settings.LLMGW_EVICT_MIN_IDLE_SECONDS,
            min_residency=settings.LLMGW_MIN_RESIDENCY_SECONDS,
            max_priority=priority,
        )
        chosen = [h for h in evictable if h.replica_id in serving]
        if len(chosen) < len(serving):
            log.info("cannot wake replica %s of %s yet: its GPUs' occupants may not be evicted", replica_id, name)
            continue
        for holding in chosen:
            spare[holding.model] -= 1
            victims[holding.replica_id] = (f"swapped out for {name}", levels.get(holding.replica_id, 0))
        taken |= gpus[replica_id]
        log.info("swapping %s in: evicting replicas %s", name, sorted(serving))
    count = wake_replicas(woken, now, outbox)
    if victims:
        put_to_sleep((SleepRequest(pk, level, why) for pk, (why, level) in victims.items() if level), now)
        stop_replicas(
            [
                StopRequest(Replica(pk=pk, state=ReplicaState.READY), why)
                for pk, (why, level) in victims.items()
                if not level
            ],
            now,
        )
    return count, len(victims)
