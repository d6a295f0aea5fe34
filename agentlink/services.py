"""What each agent message changes, one transaction per message (or per batch of hellos).

Messages arrive validated by nodewire.protocol; these functions trust them.
"""

from collections.abc import Sequence

from django.db import transaction
from django.utils import timezone

from inventory.models import Node
from inventory.services import record_heartbeat, record_weights_status, register_nodes
from inventory.staging import record_staging_status
from nodewire.adapter_messages import AdapterStatus
from nodewire.protocol import Heartbeat, Hello, StagingStatus, WeightsStatus
from reconciler.adapters import reconcile_held, record_adapter_statuses
from reconciler.agent_reports import (
    reconcile_reported_shards_of_nodes,
    record_running,
    stop_orphan_shards,
)
from reconciler.catalog_changes import publish_endpoint_table
from reconciler.commands import send_pending_soon_to
from reconciler.lifecycle.gpu_faults import fail_replicas_on_unhealthy_gpus, fail_replicas_on_unhealthy_gpus_of_nodes
from reconciler.lifecycle.transitions import notify_work_pending
from reconciler.outbox import Outbox


@transaction.atomic
def on_hellos(hellos: Sequence[tuple[int, Hello]]) -> list[Node]:
    """Record a batch of hellos in one transaction, all or nothing; returns each hello's node.

    What a hello changes: the node and its GPUs and weights; the shards it runs
    matched against its rows; the replicas on GPUs that went bad while the agent
    was away failed; its unacknowledged commands made due at once. Commands this
    decides (stop orphans, fail lost engines) are sent after commit. For nodes
    running nothing, the batch costs the same few statements however many
    hellos it holds. A node that said hello twice (a reconnect) is recorded in
    that order.
    """
    recorded: dict[int, Node] = {}  # position in `hellos`: its node
    for round_ in _distinct_rounds(hellos):
        nodes = register_nodes([hello for _, hello in round_])
        reconcile_reported_shards_of_nodes(
            [(node, hello.shards) for node, (_, (_, hello)) in zip(nodes, round_, strict=True)]
        )
        # A GPU that went bad while the agent was away (or is no longer reported) fails what it held.
        fail_replicas_on_unhealthy_gpus_of_nodes({node.pk: node.name for node in nodes})
        # What the agent may have missed while away goes to it at the next tick, not after the backoff.
        send_pending_soon_to([node.name for node in nodes], timezone.now())
        recorded.update((position, node) for node, (position, _) in zip(nodes, round_, strict=True))
    return [recorded[position] for position in range(len(hellos))]


def _distinct_rounds(hellos: Sequence[tuple[int, Hello]]) -> list[list[tuple[int, tuple[int, Hello]]]]:
    """(position, hello) in rounds where each node appears once, in arrival order."""
    rounds: list[list[tuple[int, tuple[int, Hello]]]] = []
    count: dict[int, int] = {}
    for position, hello in enumerate(hellos):
        turn = count.get(hello[0], 0)
        count[hello[0]] = turn + 1
        if turn == len(rounds):
            rounds.append([])
        rounds[turn].append((position, hello))
    return rounds


@transaction.atomic
def on_heartbeat(node_id: int, node_name: str, heartbeat: Heartbeat, mark_seen: bool = True) -> None:
    """The node's GPUs' health and its shards' requests in flight are recorded, and orphans stopped.

    A GPU that turned unhealthy fails the replica holding it (reconciler.lifecycle.gpu_faults).
    `mark_seen=False` leaves `last_seen` to the caller (agentlink.seen batches it).
    """
    turned_unhealthy = record_heartbeat(node_id, heartbeat, mark_seen=mark_seen)
    record_running(node_id, heartbeat.shards)
    outbox = Outbox()
    reconcile_held(node_id, node_name, heartbeat.shards, outbox)
    outbox.send_on_commit()
    stop_orphan_shards(node_id, node_name, heartbeat.shards)
    # Last, so the orphan check above does not take the failed replica's shards for orphans.
    if turned_unhealthy:
        fail_replicas_on_unhealthy_gpus(node_id, node_name, [gpu.pk for gpu in turned_unhealthy])


def on_weights_status(node_id: int, status: WeightsStatus) -> None:
    """Apply the node's answer to remove_weights (inventory.services does it)."""
    record_weights_status(Node.objects.get(pk=node_id), status)


def on_staging_status(node_id: int, status: StagingStatus) -> None:
    """Record where a stage stands; one that finished wakes the ticker, so a replica waiting for it is placed
    (or fails) now rather than at the next beat."""
    if record_staging_status(node_id, status, timezone.now()):
        transaction.on_commit(notify_work_pending)


def on_adapter_status(node_id: int, status: AdapterStatus) -> None:
    """Apply the node's answer to load_adapter or unload_adapter; an adapter now loaded is published at once,
    so requests held for it go on without waiting for the next tick."""
    with transaction.atomic():
        loaded = record_adapter_statuses(node_id, [status], timezone.now())
    if loaded:
        publish_endpoint_table()
