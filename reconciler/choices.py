"""Constant-backed choices for replicas and shards."""

from django.db import models


class ReplicaState(models.TextChoices):
    PENDING = "pending", "pending (waiting for placement)"
    STARTING = "starting", "starting"
    READY = "ready", "ready"
    SLEEPING = "sleeping", "sleeping (GPUs given up, engine kept)"
    WAKING = "waking", "waking"
    STOPPING = "stopping", "stopping"
    FAILED = "failed", "failed (backing off)"


class ShardState(models.TextChoices):
    ASSIGNED = "assigned", "assigned (start sent)"
    STARTING = "starting", "starting"
    READY = "ready", "ready"
    FALLING_ASLEEP = "falling_asleep", "falling asleep (sleep sent)"
    SLEEPING = "sleeping", "sleeping"
    WAKING = "waking", "waking (wake sent)"
    STOPPING = "stopping", "stopping"
    STOPPED = "stopped", "stopped"
    FAILED = "failed", "failed"


# A profile's replicas that count towards its min and max, and a model's "wanted" in
# status. FAILED ones count too: they come back as PENDING after their backoff, so
# replacing them at once would defeat the backoff and overshoot max when they return.
# Sleepers count towards max (they keep their engines), not towards min (they serve nothing).
WANTED_STATES = (
    ReplicaState.PENDING,
    ReplicaState.STARTING,
    ReplicaState.READY,
    ReplicaState.SLEEPING,
    ReplicaState.WAKING,
    ReplicaState.FAILED,
)
AWAKE_STATES = (
    ReplicaState.PENDING,
    ReplicaState.STARTING,
    ReplicaState.READY,
    ReplicaState.WAKING,
    ReplicaState.FAILED,
)
"""The wanted replicas that count towards a model's min: every wanted one but a sleeper."""


class Hold(models.TextChoices):
    """Why a pending replica that found no room is still expected to be placed soon (routers hold its requests).

    Empty: not holding — either placed, or unplaceable until an operator acts.
    """

    NONE = "", "not holding"
    MAKING_ROOM = "making_room", "making room (victims draining)"
    WAITING_FOR_NODES = "waiting_for_nodes", "waiting for nodes to report in"
    STAGING = "staging", "staging (its weights are being fetched to its nodes, no GPU held)"


class AdapterLoadState(models.TextChoices):
    """Where a LoRA adapter stands on one replica (reconciler.adapters)."""

    LOADING = "loading", "loading (load sent)"
    LOADED = "loaded", "loaded"
    UNLOADING = "unloading", "unloading (unload sent)"
