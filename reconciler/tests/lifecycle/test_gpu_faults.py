"""A held GPU turning unhealthy fails its replica, which is placed again elsewhere after its backoff."""

from datetime import timedelta

import pytest
from django.utils import timezone

from agentlink.services import on_heartbeat, on_hellos
from inventory.choices import GPUHealth as Health
from inventory.models import GPU
from nodewire.parts import GPUHealth, GPUReport, RunningShard, ShardHeartbeat
from nodewire.protocol import Heartbeat, Hello
from reconciler.choices import ReplicaState
from reconciler.models import Replica, Shard
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


def heartbeat(gpus: int, shards=(), sick=None) -> Heartbeat:
    """A heartbeat of `gpus` GPUs, all healthy but `sick` = {index: reason}."""
    sick = sick or {}
    return Heartbeat(
        gpus=[GPUHealth(index=i, healthy=i not in sick, reason=sick.get(i, "")) for i in range(gpus)],
        shards=[ShardHeartbeat(shard_id=s.pk, state="ready", running=0) for s in shards],
    )


@pytest.fixture
def beat(django_capture_on_commit_callbacks):
    def send(node, message):
        with django_capture_on_commit_callbacks(execute=True):
            on_heartbeat(node.pk, node.name, message)

    return send


def test_a_held_gpu_turning_unhealthy_fails_its_replica_and_stops_its_shards(beat, agent_inbox):
    a, b = make_node("gpu-a", gpus=2), make_node("gpu-b", gpus=2)
    inbox_a, inbox_b = agent_inbox("gpu-a"), agent_inbox("gpu-b")
    profile = make_model("llama", nodes_per_replica=2, gpus_per_node=2).profiles.get()
    replica = make_replica(profile, placement=[(a, [0, 1]), (b, [0, 1])])
    shard_a, shard_b = replica.shards.order_by("rank")
    before = timezone.now()

    beat(a, heartbeat(2, [shard_a], sick={1: "XID 79"}))

    replica.refresh_from_db()
    assert replica.state == ReplicaState.FAILED and replica.failure_count == 1
    assert replica.last_error == "GPU 1 on gpu-a is unhealthy: XID 79"
    assert replica.next_attempt_at >= before + timedelta(seconds=5)  # the usual backoff
    assert not Shard.objects.exists()
    assert [(c["type"], c["shard_id"]) for c in inbox_a()] == [("stop_shard", shard_a.pk)]
    assert [(c["type"], c["shard_id"]) for c in inbox_b()] == [("stop_shard", shard_b.pk)]
    gpu = GPU.objects.get(node=a, index=1)
    assert (gpu.health, gpu.health_reason, gpu.healthy_since) == (Health.UNHEALTHY, "XID 79", None)


def test_an_unhealthy_gpu_nobody_holds_fails_nothing_and_other_replicas_keep_running(beat):
    node = make_node("gpu-a", gpus=4)
    profile = make_model("llama", max_replicas=2).profiles.get()
    kept = make_replica(profile, placement=[(node, [0])])
    beat(node, heartbeat(4, kept.shards.all(), sick={3: "2 uncorrectable ECC error(s)"}))
    kept.refresh_from_db()
    assert kept.state == ReplicaState.READY and kept.shards.exists()
    assert GPU.objects.get(node=node, index=3).health_reason == "2 uncorrectable ECC error(s)"


def test_the_replica_is_placed_elsewhere_after_its_backoff_and_the_gpu_waits_out_its_quarantine(
    beat, run_tick, settings
):
    settings.LLMGW_GPU_QUARANTINE_SECONDS = 300
    a, b = make_node("gpu-a", gpus=1), make_node("gpu-b", gpus=1)
    make_model("llama")
    run_tick()
    first = Shard.objects.get()
    sick, other = (a, b) if first.node_id == a.pk else (b, a)
    beat(sick, heartbeat(1, [first], sick={0: "thermal slowdown"}))
    # Healthy again at once: the card is in quarantine, so the retry goes to the other node.
    beat(sick, heartbeat(1))
    assert GPU.objects.get(node=sick).health_reason == ""
    failed_at = timezone.now()
    run_tick(now=failed_at + timedelta(seconds=6))
    replica = Replica.objects.get()
    assert replica.state == ReplicaState.STARTING
    assert replica.shards.get().node == other


def test_a_gpu_the_agent_no_longer_reports_at_hello_fails_the_replica_on_it(django_capture_on_commit_callbacks):
    node = make_node("gpu-a", gpus=2)
    replica = make_replica(make_model("llama").profiles.get(), placement=[(node, [1])])
    shard = replica.shards.get()
    hello = Hello(
        node="gpu-a",
        version="0.1.0",
        address="127.0.0.1",
        gpus=[GPUReport(index=0, uuid="GPU-gpu-a-0", gpu_class="H100-80GB", memory_mb=81920, healthy=True)],
        shards=[RunningShard(shard_id=shard.pk, replica_id=replica.pk, state="ready", port=shard.port)],
    )
    with django_capture_on_commit_callbacks(execute=True):
        on_hellos([(node.pk, hello)])
    replica.refresh_from_db()
    assert replica.state == ReplicaState.FAILED
    assert replica.last_error == "GPU 1 on gpu-a is unhealthy: no longer reported by the node's agent"


def test_a_steady_heartbeat_writes_no_gpu_row_and_a_change_costs_a_fixed_few_queries(
    django_assert_num_queries, django_capture_on_commit_callbacks
):
    node = make_node("gpu-a", gpus=8)
    shards = [make_replica(make_model(f"m{i}").profiles.get(), placement=[(node, [i])]).shards.get() for i in range(4)]
    # As agentlink's heartbeat cost test counts: savepoint, node alive, GPU read, running read (+write), orphans.
    on_heartbeat(node.pk, node.name, heartbeat(8, shards))
    with django_assert_num_queries(6) as steady:
        on_heartbeat(node.pk, node.name, heartbeat(8, shards))
    assert not [q for q in steady.captured_queries if "UPDATE" in q["sql"] and "inventory_gpu" in q["sql"]]
    # A reason changing on an already unhealthy, unheld GPU: one more query (its update), nothing failed.
    on_heartbeat(node.pk, node.name, heartbeat(8, shards, sick={7: "XID 48"}))
    with django_assert_num_queries(7):
        on_heartbeat(node.pk, node.name, heartbeat(8, shards, sick={7: "XID 48; XID 63"}))
    assert GPU.objects.get(node=node, index=7).health_reason == "XID 48; XID 63"
