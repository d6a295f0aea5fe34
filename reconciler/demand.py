"""How many replicas each profile wants: min/max, activations from routers, idle scale-down.

Above min replicas, a READY replica unused for longer than its profile's idle
timeout is stopped. Only a known last use counts: a replica whose last use is
unknown is never stopped for idleness (DESIGN invariant 3).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from catalog.models import Alias, Profile

from .choices import WANTED_STATES, ReplicaState
from .lifecycle import stop_replicas
from .models import Replica

log = logging.getLogger(__name__)

# When a profile has too many replicas, stop the ones holding least first.
_STOP_ORDER = {ReplicaState.FAILED: 0, ReplicaState.PENDING: 1, ReplicaState.STARTING: 2, ReplicaState.READY: 3}


@dataclass
class DemandOutcome:
    """What applying demand changed."""

    created: int = 0
    stopping: int = 0
    deleted: int = 0
    idle_stopped: int = 0
    unknown_activations: list[str] = field(default_factory=list)


def apply_demand(activations: set[str], now: datetime) -> DemandOutcome:
    """Keep each profile between min and max replicas, honour activations, stop disabled models. Three queries."""
    outcome = DemandOutcome()
    profiles = list(Profile.objects.select_related("model").order_by("model_id", "order", "id"))
    replicas = list(
        Replica.objects.exclude(state=ReplicaState.STOPPING).only("id", "model_id", "profile_id", "state", "last_used")
    )
    by_profile: dict[int, list[Replica]] = defaultdict(list)
    for replica in replicas:
        by_profile[replica.profile_id].append(replica)

    to_create: list[Replica] = []
    to_stop: list[Replica] = []
    first_profile: dict[str, Profile] = {}
    wanted_by_model: dict[int, int] = defaultdict(int)
    for profile in profiles:
        mine = by_profile.get(profile.pk, [])
        if not profile.model.enabled:
            to_stop.extend(mine)
            continue
        first_profile.setdefault(profile.model.name, profile)
        wanted = [r for r in mine if r.state in WANTED_STATES]
        if len(wanted) < profile.min_replicas:
            to_create.extend(
                Replica(model_id=profile.model_id, profile=profile) for _ in range(profile.min_replicas - len(wanted))
            )
        elif len(wanted) > profile.max_replicas:
            # Newest first within a state: keep the replicas that have been serving longest.
            ranked = sorted(wanted, key=lambda r: (_STOP_ORDER[r.state], -r.pk))
            excess = len(wanted) - profile.max_replicas
            to_stop.extend(ranked[:excess])
            wanted = ranked[excess:]
        if profile.idle_timeout_seconds is not None and len(wanted) > profile.min_replicas:
            idle = _idle_beyond_timeout(wanted, profile, now)[: len(wanted) - profile.min_replicas]
            to_stop.extend(idle)
            outcome.idle_stopped += len(idle)
            wanted = [r for r in wanted if r not in idle]
        wanted_by_model[profile.model_id] += max(len(wanted), profile.min_replicas)

    if activations:
        to_create.extend(_activate(activations, first_profile, wanted_by_model, outcome))

    if to_create:
        Replica.objects.bulk_create(to_create)
        outcome.created = len(to_create)
    outcome.deleted, outcome.stopping = stop_replicas(to_stop)
    return outcome


def _idle_beyond_timeout(wanted: list[Replica], profile: Profile, now: datetime) -> list[Replica]:
    """READY replicas with a known last use older than the profile's idle timeout, longest idle first."""
    cutoff = now - timedelta(seconds=profile.idle_timeout_seconds or 0)
    return sorted(
        (r for r in wanted if r.state == ReplicaState.READY and r.last_used is not None and r.last_used < cutoff),
        key=lambda r: r.last_used,
    )


def _activate(
    activations: set[str], first_profile: dict[str, Profile], wanted_by_model: dict[int, int], outcome: DemandOutcome
) -> list[Replica]:
    """One new replica (on the model's first profile) per activated model that wants none; aliases resolve."""
    created = []
    unresolved = activations - first_profile.keys()
    names = {name: name for name in activations}
    if unresolved:
        names.update(Alias.objects.filter(name__in=unresolved).values_list("name", "model__name"))
    for requested in sorted(activations):
        profile = first_profile.get(names[requested])
        if profile is None:
            outcome.unknown_activations.append(requested)
            continue
        if wanted_by_model[profile.model_id] == 0:
            created.append(Replica(model_id=profile.model_id, profile=profile))
            wanted_by_model[profile.model_id] = 1
    if outcome.unknown_activations:
        log.warning("activation requested for unknown or disabled models: %s", outcome.unknown_activations)
    return created
