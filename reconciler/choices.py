"""Constant-backed choices for replicas and shards."""

from django.db import models


class ReplicaState(models.TextChoices):
    PENDING = "pending", "pending (waiting for placement)"
    STARTING = "starting", "starting"
    READY = "ready", "ready"
    STOPPING = "stopping", "stopping"
    FAILED = "failed", "failed (backing off)"


class ShardState(models.TextChoices):
    ASSIGNED = "assigned", "assigned (start sent)"
    STARTING = "starting", "starting"
    READY = "ready", "ready"
    STOPPING = "stopping", "stopping"
    STOPPED = "stopped", "stopped"
    FAILED = "failed", "failed"
