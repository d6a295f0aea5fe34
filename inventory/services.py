"""Inventory changes: enrolling nodes and recording what their agents report."""

import json
import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from django.db import transaction
from django.utils import timezone
from msgspec import UNSET

from hub.credentials import hash_secret
from inventory.choices import GPUHealth, NodeState
from inventory.models import GPU, Node, NodeCredential, Weights
from inventory.staging import forget_stages_of
from nodewire.protocol import Heartbeat, Hello, WeightsStatus, to_builtins
from nodewire.weights.messages import WeightsReport

log = logging.getLogger(__name__)

HEALTH_FIELDS = ["health", "healthy_since", "health_reason"]
# The column's length; an agent's reason is cut to it rather than refused (it is for people to read).
HEALTH_REASON_MAX = 500


class EnrolmentError(ValueError):
    """A node cannot be enrolled; the text says why."""


@transaction.atomic
def enrol_node(name: str, *, address: str = "", fabric: str = "", token: str | None = None) -> tuple[Node, str]:
    """Create a node with a fresh credential and return it with the plaintext token.

    The token is shown once; only its hash is stored. A node that already has a
    credential is refused, so a name cannot be taken over by another credential
    (DESIGN invariant 8).
    """
    node = Node(name=name, address=address, fabric=fabric)
    node.full_clean(validate_unique=False, exclude=["labels"])
    node, _ = Node.objects.get_or_create(name=name, defaults={"address": address, "fabric": fabric})
    if NodeCredential.objects.filter(node=node).exists():
        raise EnrolmentError(f"node “{name}” is already enrolled; delete its credential in admin to re-enrol it")
    token = token or NodeCredential.new_token()
    NodeCredential.objects.create(node=node, token_hash=hash_secret(token), prefix=token[:16])
    return node, token


def _apply_gpu_health(gpu, healthy: bool, now, reason: str = "") -> bool:
    """Update one GPU's health and the agent's reason for it; return whether anything changed.

    A GPU that turns healthy again starts a quarantine (healthy_since = now) so
    a flapping card is not handed straight back to the placer (DESIGN invariant 5).
    """
    health = GPUHealth.HEALTHY if healthy else GPUHealth.UNHEALTHY
    reason = "" if healthy else (reason or "reported unhealthy")[:HEALTH_REASON_MAX]
    reason_changed = gpu.health_reason != reason
    gpu.health_reason = reason
    if gpu.health == health:
        return reason_changed
    gpu.health = health
    gpu.healthy_since = now if healthy else None
    return True


REPORTED_NODE_FIELDS = [
    "reported_address",
    "reported_fabric",
    "reported_labels",
    "agent_version",
    "reported_host_memory_mib",
    "stages_weights",
    "weights_port",
]
# A field with more distinct new values than this in one batch is written with one CASE, not an UPDATE per value.
_UPDATES_PER_FIELD = 4


def _reported(hello: Hello) -> tuple:
    """What a hello says of the node, in REPORTED_NODE_FIELDS' order."""
    host_memory = None if hello.host_memory_mib is UNSET else hello.host_memory_mib
    # An agent without a weights root reports no weights at all (null), and cannot stage any either.
    weights_port = None if hello.weights_port is UNSET else hello.weights_port
    return (
        hello.address,
        hello.fabric,
        hello.labels,
        hello.version,
        host_memory,
        hello.weights is not None,
        weights_port,
    )


def _write_reported(nodes: list[Node], changed: dict[str, dict[str, list[int]]]) -> None:
    """Write the reported fields that changed: an UPDATE per distinct value (a fleet's hellos mostly share
    their agent version, fabric and labels), or one CASE for a field of many values (addresses).

    Django's bulk_update of every field for every node spent most of a connect storm building CASE terms.
    """
    for field, by_value in changed.items():
        if not by_value:
            continue
        if len(by_value) <= _UPDATES_PER_FIELD:
            for value, node_ids in by_value.items():
                Node.objects.filter(pk__in=node_ids).update(**{field: json.loads(value)})
        else:
            ids = {node_id for node_ids in by_value.values() for node_id in node_ids}
            Node.objects.bulk_update([node for node in nodes if node.pk in ids], [field])


@transaction.atomic(savepoint=False)
def register_nodes(hellos: Sequence[tuple[int, Hello]]) -> list[Node]:
    """Record validated hellos of distinct nodes: each node's reported address, fabric and labels, and its GPUs.

    What the agent reports is kept apart from what an operator set (admin, REST,
    enrolment): the operator's address, fabric and labels are never overwritten,
    and the reports stand in only where the operator left a field empty.

    GPUs are matched by index. A GPU the agent no longer reports is marked
    unhealthy rather than deleted, so a shard holding it keeps its assignment
    until the reconciler deals with the shard.

    However many nodes: the nodes locked and updated in two statements, their
    GPUs read in one and written in at most two, their weights likewise.
    Returns the nodes in the order given; Node.DoesNotExist if one is gone.
    """
    now = timezone.now()
    ids = [node_id for node_id, _ in hellos]
    locked = {node.pk: node for node in Node.objects.select_for_update().filter(pk__in=ids).order_by("pk")}
    gpus: dict[int, dict[int, GPU]] = {node_id: {} for node_id in ids}
    for gpu in GPU.objects.filter(node_id__in=ids):
        gpus[gpu.node_id][gpu.index] = gpu
    nodes, to_create, to_update, weights = [], [], [], []
    reported: dict[str, dict[Any, list[int]]] = {field: defaultdict(list) for field in REPORTED_NODE_FIELDS}
    for node_id, hello in hellos:
        node = locked.get(node_id)
        if node is None:
            raise Node.DoesNotExist(f"node {node_id} (“{hello.node}”) is gone")
        for field, value in zip(REPORTED_NODE_FIELDS, _reported(hello), strict=True):
            if getattr(node, field) != value:
                setattr(node, field, value)
                reported[field][json.dumps(value, sort_keys=True)].append(node_id)
        node.last_seen, node.state = now, NodeState.READY
        nodes.append(node)
        created, updated = _match_gpus(node, gpus[node_id], hello, now)
        to_create += created
        to_update += updated
        if hello.weights is not None:
            weights.append((node_id, hello.weights))
    Node.objects.filter(pk__in=ids).update(last_seen=now, state=NodeState.READY)
    _write_reported(nodes, reported)
    if to_create:
        GPU.objects.bulk_create(to_create)
    if to_update:
        GPU.objects.bulk_update(to_update, ["uuid", "gpu_class", "memory_mb", *HEALTH_FIELDS])
    if weights:
        record_weights_of_nodes(weights, now)
    return nodes


def _match_gpus(node: Node, existing: dict[int, GPU], hello: Hello, now) -> tuple[list[GPU], list[GPU]]:
    """The node's GPUs to create and to update for what its hello reports (`existing` by index, consumed)."""
    to_create, to_update = [], []
    for info in hello.gpus:
        gpu = existing.pop(info.index, None)
        if gpu is None:
            to_create.append(
                GPU(
                    node=node,
                    index=info.index,
                    uuid=info.uuid,
                    gpu_class=info.gpu_class,
                    memory_mb=info.memory_mb,
                    health=GPUHealth.HEALTHY if info.healthy else GPUHealth.UNHEALTHY,
                    health_reason="" if info.healthy else (info.reason or "reported unhealthy")[:HEALTH_REASON_MAX],
                )
            )
            continue
        changed = _apply_gpu_health(gpu, info.healthy, now, info.reason)
        for field in ("uuid", "gpu_class", "memory_mb"):
            if getattr(gpu, field) != getattr(info, field):
                setattr(gpu, field, getattr(info, field))
                changed = True
        if changed:
            to_update.append(gpu)
    for gpu in existing.values():
        if _apply_gpu_health(gpu, False, now, "no longer reported by the node's agent"):
            to_update.append(gpu)
    return to_create, to_update


def mark_nodes_seen(node_ids, now) -> int:
    """Nodes heard from: alive (READY) as of `now`, in one UPDATE however many; returns rows updated."""
    return Node.objects.filter(pk__in=list(node_ids)).update(last_seen=now, state=NodeState.READY)


# Part of the heartbeat's transaction (agentlink.services.on_heartbeat): no savepoint of its own.
@transaction.atomic(savepoint=False)
def record_heartbeat(node_id: int, heartbeat: Heartbeat, mark_seen: bool = True) -> list[GPU]:
    """Record a validated `heartbeat`: the node is alive (unless `mark_seen` is False: batched by the caller),
    its GPUs' health, and its weights if reported.

    Returns the GPUs that turned unhealthy with this heartbeat (their holders
    must fail). Only GPUs whose health or reason changed are written: a steady
    heartbeat reads the GPUs and writes none.
    """
    now = timezone.now()
    if mark_seen:
        mark_nodes_seen([node_id], now)
    reported = {g.index: g for g in heartbeat.gpus}
    changed, turned_unhealthy = [], []
    for gpu in GPU.objects.filter(node_id=node_id, index__in=list(reported)):
        was_healthy = gpu.health == GPUHealth.HEALTHY
        report = reported[gpu.index]
        if _apply_gpu_health(gpu, report.healthy, now, report.reason):
            changed.append(gpu)
            if was_healthy and not report.healthy:
                turned_unhealthy.append(gpu)
    if changed:
        GPU.objects.bulk_update(changed, HEALTH_FIELDS)
    if heartbeat.weights is not None:
        record_weights(node_id, heartbeat.weights, now)
    return turned_unhealthy


def record_weights(node_id: int, reported: list[WeightsReport], now) -> tuple[int, int, int]:
    """Make the node's Weights rows what the agent reports (see record_weights_of_nodes)."""
    return record_weights_of_nodes([(node_id, reported)], now)


def record_weights_of_nodes(reports: Sequence[tuple[int, list[WeightsReport]]], now) -> tuple[int, int, int]:
    """Make each node's Weights rows what its agent reports, writing only what changed.

    One read for all the nodes; then at most one insert, one update and one
    delete. Returns (created, updated, deleted).
    """
    existing: dict[int, dict[str, Weights]] = {node_id: {} for node_id, _ in reports}
    for stored in Weights.objects.filter(node_id__in=list(existing)):
        existing[stored.node_id][stored.source] = stored
    to_create: list[Weights] = []
    to_update: list[Weights] = []
    to_delete: list[int] = []
    for node_id, reported in reports:
        rows = existing[node_id]
        for item in reported:
            row = rows.pop(item.source, None)
            header = None if item.header is None else to_builtins(item.header)
            if row is None:
                to_create.append(
                    Weights(
                        node_id=node_id,
                        source=item.source,
                        path=item.path,
                        size_bytes=item.size_bytes,
                        header=header,
                        seen_at=now,
                    )
                )
            elif (row.path, row.size_bytes, row.header) != (item.path, item.size_bytes, header):
                row.path, row.size_bytes, row.header, row.seen_at = item.path, item.size_bytes, header, now
                to_update.append(row)
        to_delete += [row.pk for row in rows.values()]
    if to_create:
        Weights.objects.bulk_create(to_create)
    if to_update:
        Weights.objects.bulk_update(to_update, ["path", "size_bytes", "header", "seen_at"])
    if to_delete:
        gone = Weights.objects.filter(pk__in=to_delete)
        forget_stages_of(gone)
        gone.delete()
    return len(to_create), len(to_update), len(to_delete)


def record_weights_status(node: Node, status: WeightsStatus) -> bool:
    """Apply an agent's answer to remove_weights: forget the weights if removed, else keep them and warn.

    Returns whether a row was deleted.
    """
    if not status.removed:
        log.warning("node %s kept the weights of %s at %s: %s", node.name, status.source, status.path, status.message)
        return False
    log.info("node %s removed the weights of %s (%s)", node.name, status.source, status.message)
    gone = Weights.objects.filter(node=node, source=status.source, path=status.path)
    forget_stages_of(gone)
    deleted, _ = gone.delete()
    return deleted > 0
