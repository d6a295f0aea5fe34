"""Node liveness: unreachable, then lost; a new leader waits one window."""

from datetime import timedelta

import pytest
from django.utils import timezone

from inventory.choices import NodeState
from inventory.models import Node
from inventory.services import record_heartbeat
from nodewire.protocol import Heartbeat
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


@pytest.mark.parametrize("start_timeout", [None, 60])
def test_replicas_of_a_lost_node_are_placed_on_another_node_in_the_same_tick(run_tick, settings, start_timeout):
    """With a start timeout of 60 s the start is stuck too: the tick reads the shards on lost nodes and the stuck
    ones together, and a shard that is both fails once, as its node's."""
    settings.LLMGW_UNREACHABLE_AFTER_SECONDS, settings.LLMGW_LOST_AFTER_SECONDS = 20, 120
    if start_timeout is not None:
        settings.LLMGW_SHARD_START_TIMEOUT_SECONDS = start_timeout
    make_node("gpu-a")
    make_model("llama")
    run_tick()
    make_node("gpu-b")
    Node.objects.filter(name="gpu-b").update(last_seen=timezone.now() + timedelta(seconds=130))

    lost = run_tick(now=timezone.now() + timedelta(seconds=130))

    assert (lost.nodes_lost, lost.replicas_failed, lost.replicas_placed) == (1, 1, 1)
    replica = Replica.objects.get()
    assert (replica.state, replica.failure_count) == (ReplicaState.STARTING, 0)
    assert replica.last_error == "node lost: no heartbeat"
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
    assert [e.model for e in build_endpoint_table().endpoints] == ["llama"]

    Node.objects.filter(pk=node.pk).update(last_seen=timezone.now() - timedelta(seconds=30))
    run_tick()
    assert Node.objects.get().state == NodeState.UNREACHABLE
    assert build_endpoint_table().endpoints == []
    assert Replica.objects.get().state == ReplicaState.READY  # not replaced: the node may come back

    record_heartbeat(node.pk, Heartbeat(gpus=[]))
    assert [e.model for e in build_endpoint_table().endpoints] == ["llama"]


def _silence(*names, seconds):
    Node.objects.filter(name__in=names).update(last_seen=timezone.now() - timedelta(seconds=seconds))


def test_many_nodes_silent_at_once_engage_the_partition_brake(run_tick, settings):
    settings.LLMGW_UNREACHABLE_AFTER_SECONDS, settings.LLMGW_LOST_AFTER_SECONDS = 20, 120
    settings.LLMGW_PARTITION_BRAKE_FRACTION = 0.3
    for name in ("gpu-a", "gpu-b", "gpu-c", "gpu-d"):
        make_node(name, gpus=1)
    make_model("llama", min_replicas=4, max_replicas=4)
    run_tick()
    _silence("gpu-a", "gpu-b", seconds=130)  # 2 of 4 > 0.3: more likely our network than theirs

    braked = run_tick()

    assert (braked.partition_brake, braked.nodes_lost, braked.replicas_failed) == (True, 0, 0)
    assert set(Node.objects.values_list("state", flat=True)) == {NodeState.UNREACHABLE, NodeState.READY}
    assert Shard.objects.count() == 4  # nothing replaced

    record_heartbeat(Node.objects.get(name="gpu-b").pk, Heartbeat(gpus=[]))  # one comes back
    released = run_tick()
    assert (released.partition_brake, released.nodes_lost) == (False, 1)  # one silent node is just a lost node
    assert Node.objects.get(name="gpu-a").state == NodeState.LOST


def test_a_single_silent_node_never_engages_the_brake(run_tick, settings):
    settings.LLMGW_UNREACHABLE_AFTER_SECONDS, settings.LLMGW_LOST_AFTER_SECONDS = 20, 120
    settings.LLMGW_PARTITION_BRAKE_FRACTION = 0.3
    for name in ("gpu-a", "gpu-b", "gpu-c"):
        make_node(name, gpus=1)
    _silence("gpu-a", seconds=130)  # 1 of 3 is above 0.3, but one node alone is no partition
    result = run_tick()
    assert (result.partition_brake, result.nodes_lost) == (False, 1)


def test_an_operator_declaring_a_node_lost_overrides_the_brake(run_tick, settings):
    settings.LLMGW_UNREACHABLE_AFTER_SECONDS, settings.LLMGW_LOST_AFTER_SECONDS = 20, 120
    for name in ("gpu-a", "gpu-b", "gpu-c"):
        make_node(name, gpus=1)
    make_model("llama")
    run_tick()
    on = Shard.objects.get().node.name
    others = [n for n in ("gpu-a", "gpu-b", "gpu-c") if n != on]
    _silence(on, others[0], seconds=130)
    assert run_tick().partition_brake is True

    Node.objects.filter(name=on).update(state=NodeState.LOST)  # what the admin action does
    confirmed = run_tick()

    assert confirmed.replicas_failed == 1 and confirmed.replicas_placed == 1
    assert Shard.objects.get().node.name == others[1]
