"""Spare replicas: how a model scaled out on its latency objectives comes back down once its load has fallen.

Scale-in is the idle timeout, and a replica is idle only when no request reaches it. Routers spread requests over
every replica of a model (least loaded, ties in turn), so a model scaled out for a peak and then served a light
but steady load would keep every replica forever: none is ever idle. A model with objectives therefore parks what
its objectives do not need:

* once its pressure (reconciler.demand.objectives) has stayed at or below LLMGW_OBJECTIVE_SCALE_DOWN, with no
  replica starting, for a whole window (LLMGW_LATENCY_WINDOW_SECONDS, so the p90 was read on the replicas serving now), its newest serving
  replica is parked, one per window, never below its min replicas nor below one serving, and only while the
  others' pressure would stay below the up threshold were latency to follow load per replica (so parking does
  not bring itself back);
* a parked replica stays ready and published, at a priority below any profile's (`PARKED_PRIORITY`): routers send
  it requests only when the others cannot take them (ejected, KV-full), so nothing fails for it, and it becomes
  idle; the idle timeout then stops it, as any idle replica above min;
* the moment the pressure reaches LLMGW_OBJECTIVE_SCALE_UP, every parked replica is back in rotation: capacity
  that serves at once, before any new replica is started.

A parked replica counts neither as serving (the pressure is read on the others) nor as starting.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings

from reconciler.choices import ReplicaState
from reconciler.lifecycle.replica_rows import ReplicaRow
from reconciler.models import ModelLoad, Replica

log = logging.getLogger(__name__)

PARKED_PRIORITY = -(2**15) - 1
"""The priority a parked replica is published with: below the lowest a profile may set (a small integer)."""


@dataclass
class SpareChanges:
    """Replicas to park and to bring back in rotation this tick (applied after every model is decided)."""

    park: list[int] = field(default_factory=list)
    recall: list[int] = field(default_factory=list)

    def apply(self, now: datetime) -> None:
        """At most two queries, none when nothing changes."""
        if self.park:
            Replica.objects.filter(pk__in=self.park, state=ReplicaState.READY).update(parked_since=now)
            log.info("parking spare replicas %s: their models meet their objectives without them", self.park)
        if self.recall:
            Replica.objects.filter(pk__in=self.recall).update(parked_since=None)
            log.info("spare replicas %s back in rotation", self.recall)


def serving_and_parked(wanted: list[ReplicaRow]) -> tuple[list[ReplicaRow], list[ReplicaRow]]:
    """A model's ready replicas in rotation, and its parked ones."""
    ready = [r for r in wanted if r.state == ReplicaState.READY]
    return [r for r in ready if r.parked_since is None], [r for r in ready if r.parked_since is not None]


def decide(
    load: ModelLoad,
    pressure: float | None,
    serving: list[ReplicaRow],
    parked: list[ReplicaRow],
    min_replicas: int,
    now: datetime,
    changes: SpareChanges,
    starting: int = 0,
) -> int:
    """Park or recall per the module docstring, keeping `load.calm_since`; returns the replicas recalled (capacity
    that need not be started). Nothing is calm while `starting` replicas are on their way: their discount lowers the
    pressure of a model that is short of capacity right now."""
    if pressure is not None and pressure >= settings.LLMGW_OBJECTIVE_SCALE_UP:
        load.calm_since = None
        changes.recall.extend(r.pk for r in parked)
        return len(parked)
    if pressure is None or pressure > settings.LLMGW_OBJECTIVE_SCALE_DOWN or starting:
        load.calm_since = None
        return 0
    if load.calm_since is None:
        load.calm_since = now
        return 0
    window = timedelta(seconds=settings.LLMGW_LATENCY_WINDOW_SECONDS)
    if now - load.calm_since < window:
        return 0
    # Were latency to follow load per replica, the fewest that keep the pressure below the up threshold: parking
    # must not bring the parked back.
    keep = max(min_replicas, 1, math.floor(pressure * len(serving) / settings.LLMGW_OBJECTIVE_SCALE_UP) + 1)
    if len(serving) > keep:
        newest = sorted(serving, key=lambda r: r.pk)[keep:]  # the longest serving stay
        changes.park.extend(r.pk for r in newest)
        load.calm_since = now  # the next parking waits for a window read without them
    return 0
