"""Inventory changes: enrolling nodes and recording what their agents report."""

from django.db import transaction
from django.utils import timezone

from agent.protocol import Heartbeat, Hello
from hub.credentials import hash_secret

from .choices import GPUHealth, NodeState
from .models import GPU, Node, NodeCredential


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


def _apply_gpu_health(gpu, healthy: bool, now) -> bool:
    """Update one GPU's health; return whether anything changed.

    A GPU that turns healthy again starts a quarantine (healthy_since = now) so
    a flapping card is not handed straight back to the placer (DESIGN invariant 5).
    """
    health = GPUHealth.HEALTHY if healthy else GPUHealth.UNHEALTHY
    if gpu.health == health:
        return False
    gpu.health = health
    gpu.healthy_since = now if healthy else None
    return True


@transaction.atomic
def register_node(node_id: int, hello: Hello) -> Node:
    """Record a validated `hello`: the node's address, fabric, labels and GPUs.

    GPUs are matched by index. A GPU the agent no longer reports is marked
    unhealthy rather than deleted, so a shard holding it keeps its assignment
    until the reconciler deals with the shard.
    """
    now = timezone.now()
    node = Node.objects.select_for_update().get(pk=node_id)
    node.address = hello.address
    node.fabric = hello.fabric
    node.labels = hello.labels
    node.agent_version = hello.version
    node.last_seen = now
    node.state = NodeState.READY
    node.save(update_fields=["address", "fabric", "labels", "agent_version", "last_seen", "state"])

    existing = {gpu.index: gpu for gpu in GPU.objects.filter(node=node)}
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
                )
            )
            continue
        changed = _apply_gpu_health(gpu, info.healthy, now)
        for field in ("uuid", "gpu_class", "memory_mb"):
            if getattr(gpu, field) != getattr(info, field):
                setattr(gpu, field, getattr(info, field))
                changed = True
        if changed:
            to_update.append(gpu)
    for gpu in existing.values():
        if _apply_gpu_health(gpu, False, now):
            to_update.append(gpu)
    GPU.objects.bulk_create(to_create)
    GPU.objects.bulk_update(to_update, ["uuid", "gpu_class", "memory_mb", "health", "healthy_since"])
    return node


def mark_nodes_seen(node_ids, now) -> int:
    """Nodes heard from: alive (READY) as of `now`, in one UPDATE however many; returns rows updated."""
    return Node.objects.filter(pk__in=list(node_ids)).update(last_seen=now, state=NodeState.READY)


@transaction.atomic
def record_heartbeat(node_id: int, heartbeat: Heartbeat, mark_seen: bool = True) -> None:
    """Record a validated `heartbeat`: the node is alive (unless `mark_seen` is False: batched by the caller),
    and its GPUs' health."""
    now = timezone.now()
    if mark_seen:
        mark_nodes_seen([node_id], now)
    reported = {g.index: g.healthy for g in heartbeat.gpus}
    changed = [
        gpu
        for gpu in GPU.objects.filter(node_id=node_id, index__in=list(reported))
        if _apply_gpu_health(gpu, reported[gpu.index], now)
    ]
    GPU.objects.bulk_update(changed, ["health", "healthy_since"])
