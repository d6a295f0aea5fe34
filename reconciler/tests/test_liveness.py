"""Node liveness: unreachable, then lost; a new leader waits one window."""

from datetime import timedelta

import pytest
from django.utils import timezone

from inventory.choices import NodeState
from inventory.models import Node
from reconciler.choices import ReplicaState
from reconciler.models import GPUAssignment, Replica, Shard
from tests.fleet import make_model, make_node

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
    assert (replica.state, replica.last_error) == (ReplicaState.FAILED, "node lost: no heartbeat")


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
