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
3. else it waits: the requests are held while routers keep asking — unless
   its learned start time says a cold start elsewhere is sooner than the
   swap (the occupants' time until they may be evicted, the unpublish grace
   and the learned wake time; occupants in use are swapped out at the latest
   once the demand has waited LLMGW_MAX_SWAP_WAIT_SECONDS) and the placer has
   free GPUs for it now (`placing.room_now`): then a new replica is started
   there, as an activation would, in place of the sleeper, which is stopped.

Swap-aware admission: models are served oldest demand first, a woken replica
is not swapped out again before the minimum residency (its `ready_at` starts
afresh), and a model waiting past LLMGW_MAX_SWAP_WAIT_SECONDS may swap out
occupants still in use (see `wake_for_demand`).

Occupants already going to sleep or stopping are waited for, never evicted
twice. A swap its occupants' idle time or residency holds back tells the
ticker when they may go (`lifecycle.notify_work_due`), so it is not put off
by up to a tick interval more. A constant number of queries whatever the number of models.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings

from reconciler.choices import ReplicaState
from reconciler.hibernate.tier import SleepRequest, asleep_replicas, put_to_sleep, wake_replicas
from reconciler.lifecycle.transitions import StopRequest, notify_work_due, stop_replicas, unpublish_grace_seconds
from reconciler.models import GPUAssignment, Replica
from reconciler.outbox import Outbox
from reconciler.placement.eviction import (
    Occupant,
    in_use_no_reason,
    others_than,
    seconds_until_stoppable,
    stop_candidates,
)
from reconciler.placement.occupants import read_occupants, sleep_levels, spare_replicas
from reconciler.placement.placer import room_now

log = logging.getLogger(__name__)


def wake_for_demand(model_ids: Iterable[int], now: datetime, outbox: Outbox) -> tuple[int, int]:
    """Wake a sleeper of each model in `model_ids`, make room for one, or start the model elsewhere when that is
    sooner (the module docstring); returns (woken, occupants evicted).

    Models are served oldest demand first (`Replica.wanted_since`, stamped on a
    sleeper the first tick its model is wanted), so when several contend for
    the same GPUs the one waiting longest wins them. A model waiting longer
    than LLMGW_MAX_SWAP_WAIT_SECONDS may have occupants swapped out that are
    still in use — resident long enough, but not idle, or with requests in
    flight (a sleep is a drain: they finish) — so no demand starves behind
    models that are never idle.
    """
    model_ids = set(model_ids)
    if not model_ids:
        return 0, 0
    sleepers = _asleep_of(model_ids)
    if not sleepers:
        return 0, 0
    unstamped = [row[0] for row in sleepers if row[4] is None]
    if unstamped:
        Replica.objects.filter(pk__in=unstamped).update(wanted_since=now)
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
    by_model: dict[int, list[_Sleeper]] = defaultdict(list)
    for replica_id, model_id, name, priority, wanted_since, profile_id, start, wake in sleepers:
        waited = 0.0 if wanted_since is None else (now - wanted_since).total_seconds()
        timing = _Timing(profile_id, start, wake)
        by_model[model_id].append(_Sleeper(replica_id, model_id, name, priority, waited, gpus[replica_id], timing))
    # Oldest demand first: the model waiting longest gets the GPUs it contends for.
    order = sorted(by_model.values(), key=lambda group: -max(s.waited for s in group))
    swaps = _Swaps(now, awake_on)
    for group in order:
        swaps.serve(group)
    count = wake_replicas(swaps.woken, now, outbox)
    swaps.evict(now)
    swaps.start_elsewhere(now)
    if swaps.next_try is not None:
        notify_work_due(swaps.next_try)
    return count, len(swaps.victims)


def _asleep_of(model_ids: set[int]) -> list[tuple]:
    """The asleep replicas of `model_ids`, most recently used first per model, as the rows a swap decides on."""
    return list(
        Replica.objects.filter(asleep_replicas(), model_id__in=model_ids)
        .order_by("model_id", "-last_used", "id")
        .values_list(
            "id",
            "model_id",
            "model__name",
            "profile__priority",
            "wanted_since",
            "profile_id",
            "profile__start_seconds",
            "profile__wake_seconds",
        )
    )


@dataclass(frozen=True)
class _Timing:
    profile_id: int
    start_seconds: float | None  # learned cold start of its profile
    wake_seconds: float | None  # learned wake


@dataclass
class _Sleeper:
    replica_id: int
    model_id: int
    model: str
    priority: int
    waited: float  # seconds its model has wanted it
    gpus: set[int]
    timing: _Timing


class _Swaps:
    """One tick's decisions: sleepers to wake, occupants to evict, GPUs claimed."""

    def __init__(self, now: datetime, awake_on: dict[int, tuple[int, str]]):
        self.now, self.awake_on = now, awake_on
        self.woken: list[int] = []
        self.taken: set[int] = set()  # GPUs a wake or an eviction of this tick has claimed
        self.victims: dict[int, tuple[str, int]] = {}  # occupant replica id -> (why, sleep level)
        self._occupants: list[Occupant] | None = None
        self._spare: dict[str, int] = {}
        self._levels: dict[int, int] = {}
        self.elsewhere: list[_Sleeper] = []  # swaps slower than a cold start: started elsewhere if there is room
        self.next_try: float | None = None  # seconds until the first blocked swap may go ahead

    def serve(self, group: list[_Sleeper]) -> None:
        """Wake one of a model's sleepers whose GPUs are free, else make room for its most recently used one."""
        free = [s for s in group if not s.gpus & (self.taken | self.awake_on.keys())]
        if free:
            self.woken.append(free[0].replica_id)
            self.taken |= free[0].gpus
            return
        sleeper = group[0]
        if sleeper.gpus & self.taken:
            return  # another swap of this tick is using those GPUs
        occupants = {self.awake_on[g] for g in sleeper.gpus if g in self.awake_on}
        serving = {occupant for occupant, state in occupants if state == ReplicaState.READY}
        if not serving:
            return  # its occupants are already going to sleep or stopping: woken once they are gone
        chosen = [h for h in self._evictable(sleeper) if h.replica_id in serving]
        if len(chosen) < len(serving):
            log.info(
                "cannot wake replica %s of %s yet: its GPUs' occupants may not be evicted",
                sleeper.replica_id,
                sleeper.model,
            )
            wait = self._swap_wait(sleeper, serving)
            if wait:  # (0: blocked by something no clock ends; the regular ticks look again)
                self.next_try = min(wait, self.next_try if self.next_try is not None else wait)
            start, wake = sleeper.timing.start_seconds, sleeper.timing.wake_seconds or 0.0
            if start is not None and (wait is None or start < wait + unpublish_grace_seconds() + wake):
                self.elsewhere.append(sleeper)  # a cold start beats waiting for the swap
            return
        for holding in chosen:
            self._spare[holding.model] -= 1
            self.victims[holding.replica_id] = (
                f"swapped out for {sleeper.model}",
                self._levels.get(holding.replica_id, 0),
            )
        self.taken |= sleeper.gpus
        log.info("swapping %s in: evicting replicas %s", sleeper.model, sorted(serving))

    def _evictable(self, sleeper: _Sleeper) -> list[Occupant]:
        if self._occupants is None:
            self._occupants, self._spare = read_occupants(self.now), spare_replicas()
            self._levels = sleep_levels([h.replica_id for h in self._occupants])
        overdue = sleeper.waited >= settings.LLMGW_MAX_SWAP_WAIT_SECONDS
        others = others_than(sleeper.model, self._occupants, self.victims)
        if overdue:
            others = in_use_no_reason(others, settings.LLMGW_EVICT_MIN_IDLE_SECONDS)
        return stop_candidates(
            others,
            self._spare,
            min_idle=settings.LLMGW_EVICT_MIN_IDLE_SECONDS,
            min_residency=settings.LLMGW_MIN_RESIDENCY_SECONDS,
            max_priority=sleeper.priority,
        )

    def _swap_wait(self, sleeper: _Sleeper, serving: set[int]) -> float | None:
        """Seconds until `serving`, the occupants of the sleeper's GPUs, may be swapped out; None: not by time."""
        assert self._occupants is not None  # read by _evictable
        occupants = [h for h in self._occupants if h.replica_id in serving]
        one_day = stop_candidates(
            occupants,
            self._spare,
            min_idle=settings.LLMGW_EVICT_MIN_IDLE_SECONDS,
            min_residency=settings.LLMGW_MIN_RESIDENCY_SECONDS,
            max_priority=sleeper.priority,
            soon=True,
        )
        if len(one_day) < len(occupants):
            return None  # a higher priority, its min or unknown idleness protects an occupant
        until = seconds_until_stoppable(
            occupants,
            min_idle=settings.LLMGW_EVICT_MIN_IDLE_SECONDS,
            min_residency=settings.LLMGW_MIN_RESIDENCY_SECONDS,
        )
        if until is None:  # in use: swapped out anyway once the demand has waited the max swap wait
            until = max(0.0, settings.LLMGW_MAX_SWAP_WAIT_SECONDS - sleeper.waited)
        return until

    def start_elsewhere(self, now: datetime) -> None:
        """A new replica, in place of the sleeper, for each model whose swap waits longer than a cold start
        and that has room on free GPUs now: the sleeper is stopped, the placer starts the new one this tick."""
        linger = now + timedelta(seconds=settings.LLMGW_ACTIVATION_LINGER_SECONDS)
        replaced = []
        for sleeper in self.elsewhere:
            replica = Replica(model_id=sleeper.model_id, profile_id=sleeper.timing.profile_id, demand_until=linger)
            if not room_now(replica, now, replacing=sleeper.replica_id):
                continue
            Replica(model_id=sleeper.model_id, profile_id=sleeper.timing.profile_id, demand_until=linger).save()
            why = "started elsewhere instead: sooner than waiting to wake it"
            replaced.append(StopRequest(Replica(pk=sleeper.replica_id, state=ReplicaState.SLEEPING), why))
            log.info("starting %s on free GPUs: sooner than waking replica %s", sleeper.model, sleeper.replica_id)
        stop_replicas(replaced, now)

    def evict(self, now: datetime) -> None:
        """Put the chosen occupants to sleep (or stop those that cannot sleep)."""
        if not self.victims:
            return
        put_to_sleep((SleepRequest(pk, level, why) for pk, (why, level) in self.victims.items() if level), now)
        stop_replicas(
            [
                StopRequest(Replica(pk=pk, state=ReplicaState.READY), why)
                for pk, (why, level) in self.victims.items()
                if not level
            ],
            now,
        )
