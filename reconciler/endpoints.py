"""The endpoint table routers serve from, built from the rows (published by the tick, DESIGN invariant 7)."""

from __future__ import annotations

from django.db.models import Exists, OuterRef

from catalog.models import Model, Profile
from hub import EndpointTable
from inventory.choices import NodeState

from .choices import ReplicaState
from .eviction import MAKING_ROOM
from .models import Replica, Shard


def build_endpoint_table() -> EndpointTable:
    """Enabled models with a profile (with why a model cannot be placed, when it cannot, and how long
    it takes to start), and READY replicas whose nodes are all heard from. Five queries."""
    models = (
        Model.objects.filter(enabled=True)
        .filter(Exists(Profile.objects.filter(model=OuterRef("pk"))))
        .prefetch_related("aliases", "profiles")
        .order_by("name")
    )
    # A replica with a shard on a node that missed its heartbeat window takes no traffic; it
    # returns when the node's heartbeats do (DESIGN "Reconcile tick": unreachable → unpublished).
    on_silent_node = Shard.objects.filter(replica=OuterRef("pk")).exclude(node__state=NodeState.READY)
    endpoints = (
        Replica.objects.ready()
        .filter(model__enabled=True)
        .exclude(Exists(on_silent_node))
        .select_related("model", "profile")
        .order_by("id")
    )
    # Why a wanted model has no room right now, so routers can answer at once instead of holding requests.
    unplaceable: dict[str, str] = {}
    for name, reason in (
        Replica.objects.filter(state=ReplicaState.PENDING, model__enabled=True)
        .exclude(placement_error="")
        # Room is being made for it: routers keep holding its requests.
        .exclude(placement_error__startswith=MAKING_ROOM)
        .order_by("model__name", "profile__order", "id")
        .values_list("model__name", "placement_error")
    ):
        unplaceable.setdefault(name, reason)

    def entry(model) -> dict:
        described = {"aliases": sorted(a.name for a in model.aliases.all())}
        if model.name in unplaceable:
            described["unplaceable"] = unplaceable[model.name]
        # The first profile is the one an activation starts, so its learned start time is the ETA.
        first = min(model.profiles.all(), key=lambda p: (p.order, p.pk), default=None)
        if first is not None and first.start_seconds is not None:
            described["start_seconds"] = round(first.start_seconds, 1)
        return described

    return {
        "models": {m.name: entry(m) for m in models},
        "endpoints": [
            {
                "replica_id": str(r.pk),
                "model": r.model.name,
                "url": r.endpoint_url,
                "priority": r.profile.priority,
                "weight": r.profile.weight,
                "pool": r.profile.pool,
            }
            for r in endpoints
        ],
    }
