"""The one set of fleet builders every app's tests use: nodes with GPUs, models with a profile, placed replicas."""

import re
from datetime import timedelta

from django.utils import timezone

from catalog.models import Model, Profile
from inventory.choices import GPUHealth, NodeState
from inventory.models import GPU, Node
from reconciler.choices import ReplicaState, ShardState
from reconciler.models import GPUAssignment, Replica, Shard, UsageWatch

H100 = "H100-80GB"
_ports = iter(range(21000, 29999))


def class_memory_mb(gpu_class: str) -> int:
    """The memory (MiB) a GPU of `gpu_class` reports in tests: the size its name ends in ("L40S-48GB"), else 80 GiB."""
    match = re.search(r"-(\d+)GB$", gpu_class)
    return int(match[1]) * 1024 if match else 81920


def make_node(
    name,
    *,
    gpus=8,
    gpu_class=H100,
    fabric="",
    address="127.0.0.1",
    state=NodeState.READY,
    schedulable=True,
    memory_mb=None,
):
    """A node that has just sent a heartbeat, with `gpus` healthy GPUs of one class (memory: the class's own)."""
    memory_mb = class_memory_mb(gpu_class) if memory_mb is None else memory_mb
    node = Node.objects.create(
        name=name, address=address, fabric=fabric, state=state, schedulable=schedulable, last_seen=timezone.now()
    )
    GPU.objects.bulk_create(
        GPU(node=node, index=i, uuid=f"GPU-{name}-{i}", gpu_class=gpu_class, memory_mb=memory_mb) for i in range(gpus)
    )
    return node


def make_model(
    name, *, min_replicas=1, max_replicas=1, gpus_per_node=1, nodes_per_replica=1, enabled=True, **profile
) -> Model:
    """A model with one profile (H100 unless `gpu_class` is given); the profile is `model.profiles.get()`."""
    model = Model.objects.create(name=name, source=f"org/{name}", enabled=enabled)
    Profile.objects.create(
        model=model,
        gpu_class=profile.pop("gpu_class", H100),
        gpus_per_node=gpus_per_node,
        nodes_per_replica=nodes_per_replica,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        **profile,
    )
    return model


def make_replica(profile, *, state=ReplicaState.READY, placement=(), last_used=None, endpoint="", error=""):
    """A replica of `profile` with one shard per (node, [GPU indices]) in `placement`, rank in order."""
    replica = Replica.objects.create(
        model=profile.model,
        profile=profile,
        state=state,
        endpoint_url=endpoint,
        placement_note=error,
        last_used=last_used,
        ready_at=timezone.now() if state == ReplicaState.READY else None,
    )
    for rank, (node, indices) in enumerate(placement):
        shard = Shard.objects.create(replica=replica, node=node, rank=rank, port=next(_ports), state=ShardState.READY)
        GPUAssignment.objects.bulk_create(
            GPUAssignment(gpu=gpu, shard=shard) for gpu in node.gpus.filter(index__in=indices)
        )
    return replica


def ready_replicas(model, last_used_ago):
    """READY replicas (without shards) of `model`, one per entry: seconds since last use, or None = unknown."""
    now = timezone.now()
    return [
        Replica.objects.create(
            model=model,
            profile=model.profiles.get(),
            state=ReplicaState.READY,
            last_used=None if ago is None else now - timedelta(seconds=ago),
        )
        for ago in last_used_ago
    ]


def set_gpu(node, index, *, health=GPUHealth.HEALTHY, healthy_since=None):
    GPU.objects.filter(node=node, index=index).update(health=health, healthy_since=healthy_since)


def watch_usage(*, known_since=None, reason=""):
    """The tick's fleet usage watch: known since `known_since` (None: unknown, with `reason`)."""
    UsageWatch.objects.update_or_create(name="fleet", defaults={"known_since": known_since, "reason": reason})


def bulk_fleet(nodes, *, gpus=8, gpu_class=H100, fabrics=4, models=10, replicas=0, idle_seconds=7200.0):
    """`nodes` ready nodes (`gpu-0001`…) of `gpus` GPUs on `fabrics` fabrics, built with a few bulk inserts.

    `replicas` READY single-node replicas, spread over `models` models (2 GPUs each,
    up to gpus/2 per node), last used `idle_seconds` ago. For fleets of a thousand
    nodes, where one create per row would take minutes.
    """
    now = timezone.now()
    made = Node.objects.bulk_create(
        Node(
            name=f"gpu-{i:04d}",
            address=f"10.0.{i // 250}.{i % 250}",
            fabric=f"ib-{i % fabrics}",
            state=NodeState.READY,
            last_seen=now,
        )
        for i in range(1, nodes + 1)
    )
    made = list(Node.objects.filter(name__in=[n.name for n in made]).order_by("name"))
    GPU.objects.bulk_create(
        GPU(node=node, index=i, uuid=f"GPU-{node.name}-{i}", gpu_class=gpu_class, memory_mb=class_memory_mb(gpu_class))
        for node in made
        for i in range(gpus)
    )
    profiles = [make_model(f"bulk-{m:02d}", gpus_per_node=2, min_replicas=0).profiles.get() for m in range(models)]
    per_node = gpus // 2
    Replica.objects.bulk_create(
        Replica(
            model_id=profiles[r % models].model_id,
            profile=profiles[r % models],
            state=ReplicaState.READY,
            ready_at=now,
            last_used=now - timedelta(seconds=idle_seconds),
            endpoint_url=f"http://bulk/{r}",
        )
        for r in range(replicas)
    )
    made_replicas = list(Replica.objects.filter(endpoint_url__startswith="http://bulk/").order_by("id"))
    Shard.objects.bulk_create(
        Shard(
            replica=replica,
            node=made[r // per_node],
            rank=0,
            port=20000 + r % per_node,
            state=ShardState.READY,
        )
        for r, replica in enumerate(made_replicas)
    )
    shards = {s.replica_id: s for s in Shard.objects.filter(replica__in=made_replicas)}
    gpu_ids = {(node_id, index): gpu_id for gpu_id, node_id, index in GPU.objects.values_list("id", "node_id", "index")}
    GPUAssignment.objects.bulk_create(
        GPUAssignment(gpu_id=gpu_ids[(made[r // per_node].pk, 2 * (r % per_node) + k)], shard=shards[replica.pk])
        for r, replica in enumerate(made_replicas)
        for k in range(2)
    )
    return made
