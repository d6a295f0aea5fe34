"""Draining nodes: cordon them and stop (drain) every replica with a shard on them, in one transaction."""

from __future__ import annotations

from collections.abc import Iterable

from django.db import transaction
from django.utils import timezone

from inventory.models import Node

from .lifecycle import StopRequest, notify_work_pending, stop_replicas
from .models import Replica

NODE_DRAINED = "node drained"


def drain_nodes(node_ids: Iterable[int]) -> tuple[int, int]:
    """Cordon the nodes and stop their replicas (reason "node drained"); returns (nodes, replicas stopping
    or removed). Stopping is a drain: engines finish their requests first, and the tick places
    replacements for models below their min on other nodes, since these ones are cordoned."""
    node_ids = list(node_ids)
    with transaction.atomic():
        nodes = Node.objects.filter(pk__in=node_ids).update(schedulable=False)
        # By id, not a join with DISTINCT: PostgreSQL allows no FOR UPDATE with DISTINCT.
        on_nodes = Replica.objects.filter(shards__node_id__in=node_ids).values("pk")
        replicas = list(Replica.objects.select_for_update().filter(pk__in=on_nodes).order_by("pk"))
        deleted, stopping = stop_replicas([StopRequest(r, NODE_DRAINED) for r in replicas], timezone.now())
        notify_work_pending()
    return nodes, deleted + stopping
