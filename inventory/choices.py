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
