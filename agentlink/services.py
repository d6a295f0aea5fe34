"""What each agent message changes, one transaction per message.

Messages arrive validated by agent.protocol; these functions trust them.
"""

from django.db import transaction
from django.utils import timezone

from agent.protocol import Heartbeat, Hello, ShardStatus, WeightsStatus
from inventory.models import Node
from inventory.services import record_heartbeat, record_weights_status, register_node
from reconciler.agent_reports import (
    reconcile_reported_shards,
    record_running,
    record_shard_status,
    stop_orphan_shards,
)
from reconciler.commands import send_pending_soon
from reconciler.gpu_faults import fail_replicas_on_unhealthy_gpus


@transaction.atomic
def on_hello(node_id: int, hello: Hello) -> Node:
    """Record the node and its GPUs, and match the shards it runs against its rows, all or nothing.

    Commands this decides (stop orphans, fail lost engines) are sent after commit.
    """
    node = register_node(node_id, hello)
    reconcile_reported_shards(node, hello.shards)
    # A GPU that went bad while the agent was away (or is no longer reported) fails what it held.
    fail_replicas_on_unhealthy_gpus(node.pk, node.name)
    # What the agent may have missed while away goes to it at the next tick, not after the backoff.
    send_pending_soon(node.name, timezone.now())
    return node


@transaction.atomic
def on_heartbeat(node_id: int, node_name: str, heartbeat: Heartbeat, mark_seen: bool = True) -> None:
    """The node's GPUs' health and its shards' requests in flight are recorded, and orphans stopped.

    A GPU that turned unhealthy fails the replica holding it (reconciler.gpu_faults).
    `mark_seen=False` leaves `last_seen` to the caller (agentlink.seen batches it).
    """
    turned_unhealthy = record_heartbeat(node_id, heartbeat, mark_seen=mark_seen)
    record_running(node_id, heartbeat.shards)
    stop_orphan_shards(node_id, node_name, heartbeat.shards)
    # Last, so the orphan check above does not take the failed replica's shards for orphans.
    if turned_unhealthy:
        fail_replicas_on_unhealthy_gpus(node_id, node_name, [gpu.pk for gpu in turned_unhealthy])


def on_shard_status(node_id: int, status: ShardStatus) -> None:
    """Apply a shard_status report from the node (reconciler.agent_reports does it in one transaction)."""
    record_shard_status(Node.objects.get(pk=node_id), status)


def on_weights_status(node_id: int, status: WeightsStatus) -> None:
    """Apply the node's answer to remove_weights (inventory.services does it)."""
    record_weights_status(Node.objects.get(pk=node_id), status)
