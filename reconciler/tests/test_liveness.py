"""Node liveness: unreachable, then lost; a new leader waits one window."""

from datetime import timedelta

import pytest
from django.utils import timezone

from agent.protocol import Heartbeat
from inventory.choices import NodeState
from inventory.models import Node
from inventory.services import record_heartbeat
from reconciler.choices import ReplicaState
from reconciler.endpoints import build_endpoint_table
from reconciler.models import GPUAssignment, Replica, Shard
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


def test_silent_node_becomes_unreachable_then_lost_and_its_replicas_fail(run_tick, settings):
    settings.LLMGW_UNREACHABLE_AFTER_SECONDS, settings.LLMGW_LOST_AFTER_SECONDS = 20, 120
    node = make_node("gpu-a")
    make_model("llama")
    run_tick()
    now = timezone.now()

    assert run_tick(now=now + timedelta(seconds=30)).nodes_unreachable == 1
    node.refresh_from_db()
    assert node.state == NodeState.UNREACHABLE
    assert Replica.objects.get().state == ReplicaState.STARTING

    lost = run_tick(now=now + timedelta(seconds=130))
    node.refresh_from_db()
    assert (lost.nodes_lost, node.state) == (1, NodeState.LOST)
    assert Shard.objects.count() == 0 and GPUAssignment.objects.count() == 0
    replica = Replica.objects.get()
    # The node failed, not the replica: no backoff, waiting for room (there is no other node).
    assert (replica.state, replica.last_error, replica.failure_count) == (
        ReplicaState.PENDING,
        "node lost: no heartbeat",
        0,
    )


def test_replicas_of_a_lost_node_are_placed_on_another_node_in_the_same_tick(run_tick, settings):
    settings.LLMGW_UNREACHABLE_AFTER_SECONDS, settings.LLMGW_LOST_AFTER_SECONDS = 20, 120
    make_node("gpu-a")
    make_model("llama")
    run_tick()
    make_node("gpu-b")
    Node.objects.filter(name="gpu-b").update(last_seen=timezone.now() + timedelta(seconds=130))

    lost = run_tick(now=timezone.now() + timedelta(seconds=130))

    assert (lost.nodes_lost, lost.replicas_placed) == (1, 1)
    replica = Replica.objects.get()
    assert (replica.state, replica.failure_count) == (ReplicaState.STARTING, 0)
    assert replica.shards.get().node.name == "gpu-b"


def test_a_new_leader_declares_no_node_lost_within_one_unreachable_window(leader, run_tick, settings):
    settings.LLMGW_UNREACHABLE_AFTER_SECONDS, settings.LLMGW_LOST_AFTER_SECONDS = 20, 120
    node = make_node("gpu-a")
    Node.objects.filter(pk=node.pk).update(last_seen=timezone.now() - timedelta(seconds=600))
    leader.leader_since = timezone.now()

    result = run_tick()

    node.refresh_from_db()
    assert (result.nodes_lost, node.state) == (0, NodeState.UNREACHABLE)
    leader.leader_since = timezone.now() - timedelta(seconds=21)
    assert run_tick().nodes_lost == 1


def test_replicas_on_a_silent_node_leave_the_endpoint_table_and_return_with_its_heartbeats(run_tick, settings):
    settings.LLMGW_UNREACHABLE_AFTER_SECONDS = 20
    node = make_node("gpu-a")
    profile = make_model("llama").profiles.get()
    make_replica(profile, placement=[(node, [0])], endpoint="http://127.0.0.1:21000")
    assert [e["model"] for e in build_endpoint_table()["endpoints"]] == ["llama"]

    Node.objects.filter(pk=node.pk).update(last_seen=timezone.now() - timedelta(seconds=30))
    run_tick()
    assert Node.objects.get().state == NodeState.UNREACHABLE
    assert build_endpoint_table()["endpoints"] == []
    assert Replica.objects.get().state == ReplicaState.READY  # not replaced: the node may come back

    record_heartbeat(node.pk, Heartbeat(gpus=[]))
    assert [e["model"] for e in build_endpoint_table()["endpoints"]] == ["llama"]
