"""Constant-backed choices for the inventory."""

from django.db import models


class NodeState(models.TextChoices):
    NEW = "new", "enrolled, never connected"
    READY = "ready", "ready"
    UNREACHABLE = "unreachable", "unreachable"
    LOST = "lost", "lost"


class GPUHealth(models.TextChoices):
    HEALTHY = "healthy", "healthy"
    UNHEALTHY = "unhealthy", "unhealthy"


class StagingState(models.TextChoices):
    """Where one source's staging stands on one node (inventory.models.WeightsStage)."""

    ASKED = "asked", "asked (stage_weights sent)"
    FETCHING = "fetching", "fetching"
    READY = "ready", "ready"
    FAILED = "failed", "failed"


# The states in which a stage is still under way: a replica waiting for it waits on.
STAGING_UNDER_WAY = (StagingState.ASKED, StagingState.FETCHING)
