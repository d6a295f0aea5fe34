"""A GPU that turns unhealthy under a shard fails the shard's replica (DESIGN invariant 5).

The agent reports each GPU's health with every heartbeat (agent/gpus/health.py);
inventory records it. When a held GPU is unhealthy, its replica cannot be
trusted to serve: it fails with the node, the GPU and the agent's reason, its
other shards are stopped, and it is placed again (elsewhere: the GPU stays out
of service until it has been healthy for the quarantine period) after the
usual backoff. The failure is counted against the replica, so a card that
keeps failing does not pull the same replica back at once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from django.db import transaction
from django.utils import timezone

from inventory.choices import GPUHealth
from reconciler.lifecycle.transitions import fail_replicas, notify_work_pending
from reconciler.models import GPUAssignment
from reconciler.outbox import Outbox


def fail_replicas_on_unhealthy_gpus(node_id: int, node_name: str, gpu_ids: Iterable[int] | None = None) -> int:
    """Fail the replicas holding unhealthy GPUs of a node (only `gpu_ids` when given); return how many failed.

    One query when nothing is held; the failure itself runs in the caller's
    transaction (or its own), and stop commands go out after commit.
    """
    held = GPUAssignment.objects.filter(gpu__node_id=node_id)
    if gpu_ids is not None:
        held = held.filter(gpu_id__in=list(gpu_ids))
    return _fail_holders(held, {node_id: node_name})


def fail_replicas_on_unhealthy_gpus_of_nodes(names: Mapping[int, str]) -> int:
    """fail_replicas_on_unhealthy_gpus for several nodes (node id: name), in one query when nothing is held."""
    return _fail_holders(GPUAssignment.objects.filter(gpu__node_id__in=list(names)), names)


def _fail_holders(assignments, names: Mapping[int, str]) -> int:
    held = assignments.exclude(gpu__health=GPUHealth.HEALTHY).order_by("gpu__node_id", "gpu__index")
    rows = list(held.values_list("shard__replica_id", "gpu__node_id", "gpu__index", "gpu__health_reason"))
    if not rows:
        return 0
    reasons: dict[int, list[str]] = defaultdict(list)
    for replica_id, node_id, index, reason in rows:
        reasons[replica_id].append(f"GPU {index} on {names[node_id]} is unhealthy: {reason or 'no reason given'}")
    failed = 0
    now = timezone.now()
    with transaction.atomic():
        outbox = Outbox()
        for replica_id, lines in sorted(reasons.items()):
            failed += fail_replicas([replica_id], "; ".join(lines), now, outbox)
        outbox.send_on_commit()
        notify_work_pending()
    return failed
