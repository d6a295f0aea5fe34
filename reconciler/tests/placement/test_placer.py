"""Placing pending replicas: best fit, whole nodes on one fabric, free GPUs and ports, start commands."""

from datetime import timedelta

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from catalog.models import Profile
from inventory.choices import GPUHealth, NodeState
from inventory.models import GPU, Node
from reconciler.choices import ReplicaState, ShardState
from reconciler.models import GPUAssignment, Replica, Shard
from tests.fleet import H100, make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


def test_min_replica_is_placed_best_fit_with_shard_assignments_and_a_start_command(run_tick, leader, agent_inbox):
    roomy, snug = make_node("gpu-a", gpus=8), make_node("gpu-b", gpus=2)
    inbox = {"gpu-a": agent_inbox("gpu-a"), "gpu-b": agent_inbox("gpu-b")}
    env = {"OMP_NUM_THREADS": "2", "HF_TOKEN": "hf_sent_to_the_agent_only"}
    model = make_model("llama", gpus_per_node=2, engine_args=["--max-model-len", "8192"], env=env, max_concurrency=64)

    result = run_tick()

    replica = Replica.objects.get(model=model)
    assert (result.leader, result.replicas_created, result.replicas_placed) == (True, 1, 1)
    assert replica.state == ReplicaState.STARTING
    assert replica.epoch == leader.epoch == 1
    assert replica.started_at is not None and replica.placement_note == ""
    shard = replica.shards.get()
    assert (shard.node, shard.rank, shard.port, shard.state) == (snug, 0, 20000, ShardState.ASSIGNED)
    assert sorted(shard.gpu_assignments.values_list("gpu__index", flat=True)) == [0, 1]
    assert inbox["gpu-a"]() == []
    assert inbox["gpu-b"]() == [
        {
            "type": "start_shard",
            "v": 1,
            "epoch": 1,
            "shard_id": shard.pk,
            "replica_id": replica.pk,
            "rank": 0,
            "node_count": 1,
            "head_address": "127.0.0.1",
            "engine": "vllm",
            "model": "llama",
            "source": "org/llama",
            "gpu_indices": [0, 1],
            "port": 20000,
            # The engine's own context wins; the profile's max concurrency is passed as the engine's batch.
            "args": ["--max-model-len", "8192", "--max-num-seqs", "64"],
            "env": env,  # the profile's, secrets as they are: the engine needs them (nodewire/engine_env.py)
            "host": "127.0.0.1",
            "rendezvous_port": 0,
            # A vLLM profile with no sleep level of its own sleeps at the best level (2: its size is unknown).
            "sleep_mode": True,
        }
    ]
    assert replica.sleep_level == 2
    assert roomy.shards.count() == 0


def test_multi_node_replica_gets_whole_nodes_on_one_fabric_and_starts_its_head_first(run_tick, agent_inbox):
    make_node("gpu-a", gpus=4, fabric="ib-a", address="10.0.0.1")
    make_node("gpu-b", gpus=4, fabric="ib-a", address="10.0.0.2")
    make_node("gpu-c", gpus=4, fabric="ib-b", address="10.0.0.3")
    head_inbox, inbox = agent_inbox("gpu-a"), agent_inbox("gpu-b")
    make_model("big", gpus_per_node=4, nodes_per_replica=2)

    run_tick()

    shards = list(Shard.objects.order_by("rank").values_list("node__name", "rank", "port"))
    assert shards == [("gpu-a", 0, 20000), ("gpu-b", 1, 20000)]
    (start,) = head_inbox()
    assert (start["rank"], start["node_count"], start["head_address"]) == (0, 2, "10.0.0.1")
    # The head's rendezvous port is the one after its engine port (reconciler.placement.search.rendezvous_port).
    assert (start["port"], start["rendezvous_port"]) == (20000, 20001)
    assert inbox() == []  # rank 1 waits for its head's engine (reconciler/tests/placement/test_multi_node_order.py)


def test_unplaceable_replica_keeps_an_aggregate_explanation(run_tick):
    make_node("gpu-a", gpus=2)
    model = make_model("huge", gpus_per_node=4)

    result = run_tick()

    replica = Replica.objects.get(model=model)
    assert replica.state == ReplicaState.PENDING
    assert replica.placement_note == "needs 4×H100-80GB on one node; most free on one node: 2 (gpu-a)"
    assert result.replicas_unplaceable == 1


def test_unhealthy_and_quarantined_gpus_are_not_free(run_tick, settings):
    settings.LLMGW_GPU_QUARANTINE_SECONDS = 300
    node = make_node("gpu-a", gpus=4)
    GPU.objects.filter(node=node, index=0).update(health=GPUHealth.UNHEALTHY)
    GPU.objects.filter(node=node, index=1).update(healthy_since=timezone.now() - timedelta(seconds=10))
    GPU.objects.filter(node=node, index=2).update(healthy_since=timezone.now() - timedelta(seconds=600))
    model = make_model("llama", gpus_per_node=3)

    run_tick()
    assert Replica.objects.get(model=model).placement_note.endswith(
        "most free on one node: 2 (gpu-a); unhealthy or in quarantine: 2 on gpu-a"
    )

    Profile.objects.filter(model=model).update(gpus_per_node=2)
    run_tick()
    assert sorted(GPUAssignment.objects.values_list("gpu__index", flat=True)) == [2, 3]


def test_status_counts_free_exactly_the_gpus_the_placer_will_use(run_tick, settings):
    """DESIGN invariants 5 and 6: the summary's "free" and the placer share one rule."""
    from dashboard.summary import cluster_summary

    settings.LLMGW_GPU_QUARANTINE_SECONDS = 300
    now = timezone.now()
    node = make_node("gpu-a", gpus=6)
    GPU.objects.filter(node=node, index=0).update(health=GPUHealth.UNHEALTHY)
    GPU.objects.filter(node=node, index=1).update(healthy_since=now - timedelta(seconds=60))  # in quarantine
    GPU.objects.filter(node=node, index=2).update(healthy_since=now - timedelta(seconds=600))  # served it
    cordoned = make_node("gpu-b", gpus=2)
    Node.objects.filter(pk=cordoned.pk).update(schedulable=False)
    free = next(c for c in cluster_summary().capacity if c.gpu_class == H100).free
    assert free == 4
    make_model("llama", min_replicas=free + 2, max_replicas=free + 2)

    report = run_tick()

    assert report.replicas_placed == free and report.replicas_unplaceable == 2
    assert next(c for c in cluster_summary().capacity if c.gpu_class == H100).free == 0


def test_cordoned_and_unready_nodes_get_no_shards(run_tick):
    make_node("gpu-a").__class__.objects.filter(name="gpu-a").update(schedulable=False)
    Node.objects.filter(pk=make_node("gpu-b").pk).update(state=NodeState.NEW)
    make_model("llama")

    run_tick()

    assert Shard.objects.count() == 0
    # The reason names what is true of the nodes that have the class (one wording for ctl_status, dashboard, REST).
    assert Replica.objects.get().placement_note == (
        "every node with GPU class H100-80GB is out of service (cordoned: gpu-a; enrolled but never connected: gpu-b)"
    )


def test_an_unplaceable_reason_names_the_gpus_out_of_service(run_tick):
    node = make_node("gpu-a", gpus=2)
    GPU.objects.filter(node=node).update(health=GPUHealth.UNHEALTHY, health_reason="XID 79")
    make_model("llama")

    run_tick()

    assert Replica.objects.get().placement_note == (
        "needs 1×H100-80GB on one node; most free on one node: 0; unhealthy or in quarantine: 2 on gpu-a"
    )


def test_an_unplaceable_reason_names_draining_unreachable_and_counts_what_it_does_not_name(run_tick):
    draining = make_node("gpu-d")
    make_replica(make_model("old", min_replicas=0).profiles.get(), placement=[(draining, [0])])
    Replica.objects.update(drain_deadline=timezone.now() + timedelta(minutes=5))
    Node.objects.filter(pk=draining.pk).update(schedulable=False)
    for i in range(5):
        make_node(f"gpu-u{i}", state=NodeState.UNREACHABLE)
    make_model("llama", gpu_class=H100)

    run_tick()

    assert Replica.objects.get(model__name="llama").placement_note == (
        "every node with GPU class H100-80GB is out of service "
        "(draining: gpu-d; unreachable: gpu-u0, gpu-u1, gpu-u2 and 2 more)"
    )


def test_ports_come_from_the_range_and_are_not_reused_on_a_node(run_tick):
    make_node("gpu-a", gpus=8)
    make_model("one")
    make_model("two")

    run_tick()

    assert sorted(Shard.objects.values_list("port", flat=True)) == [20000, 20001]


def test_nodes_sharing_an_address_share_one_port_space(run_tick):
    """Simulated nodes on one box must not be handed the same engine port."""
    make_node("gpu-a", gpus=1, address="127.0.0.1")
    make_node("gpu-b", gpus=1, address="127.0.0.1")
    make_model("one")
    make_model("two")

    run_tick()

    shards = Shard.objects.order_by("port")
    assert {s.node.name for s in shards} == {"gpu-a", "gpu-b"}
    assert [s.port for s in shards] == [20000, 20001]


def test_a_gpu_held_twice_is_refused_by_the_database_constraint():
    """DESIGN invariant 2: the constraint, not the placer, stops double-booking."""
    node = make_node("gpu-a", gpus=1)
    model = make_model("llama")
    gpu = node.gpus.get()
    shards = []
    for port in (20000, 20001):
        replica = Replica.objects.create(model=model, profile=model.profiles.get(), state=ReplicaState.STARTING)
        shards.append(Shard.objects.create(replica=replica, node=node, port=port))
    GPUAssignment.objects.create(gpu=gpu, shard=shards[0])
    with pytest.raises(IntegrityError), transaction.atomic():
        GPUAssignment.objects.create(gpu=gpu, shard=shards[1])
