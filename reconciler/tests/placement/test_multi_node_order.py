"""A replica spanning nodes starts in rank order: its head first, the other ranks once the head's engine runs.

Rank 0 hosts the rendezvous the other ranks join (agent/engines/launch.py); its
rendezvous port, the one after its engine port, is reserved by the placer. The
order is read from the shard rows, so a resend (or a new leader) keeps it.
"""

from datetime import timedelta

import pytest
from django.utils import timezone

from reconciler.choices import ReplicaState, ShardState
from reconciler.commands import acknowledge
from reconciler.lifecycle.transitions import stop_replica, unpublish_grace_seconds
from reconciler.models import PendingCommand, Replica, Shard
from tests.fleet import make_model, make_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def two_nodes(agent_inbox):
    """Two 4-GPU nodes on one fabric, their inboxes, and a model wanting both for one replica."""
    nodes = [make_node(name, gpus=4, fabric="ib-a", address=f"10.0.0.{i}") for i, name in ((1, "gpu-a"), (2, "gpu-b"))]
    inboxes = [agent_inbox(node.name) for node in nodes]
    make_model("big", gpus_per_node=4, nodes_per_replica=2, engine="sglang")
    return nodes, inboxes


def test_the_other_ranks_start_once_the_head_reports_its_engine_starting(run_tick, shard_report, two_nodes):
    (head_node, other_node), (head_inbox, other_inbox) = two_nodes
    run_tick()
    head, other = Shard.objects.order_by("rank")
    (head_start,) = head_inbox()
    assert other_inbox() == []

    # Nothing the follower could join yet: a tick does not start it either.
    run_tick()
    assert other_inbox() == []

    shard_report(head_node, head, "starting")
    (start,) = other_inbox()
    assert (start["shard_id"], start["rank"], start["node_count"]) == (other.pk, 1, 2)
    assert (start["head_address"], start["rendezvous_port"]) == ("10.0.0.1", head.port + 1)
    assert (start["host"], start["port"]) == ("10.0.0.2", other.port)
    assert start["rendezvous_port"] == head_start["rendezvous_port"]

    # A second word from the head starts nothing twice.
    shard_report(head_node, head, "ready", port=head.port)
    assert other_inbox() == []
    assert Replica.objects.get().state == ReplicaState.STARTING  # not ready until every shard is

    shard_report(other_node, other, "starting")
    shard_report(other_node, other, "ready", port=other.port)
    assert Replica.objects.get().state == ReplicaState.READY
    assert Replica.objects.get().endpoint_url == f"http://10.0.0.1:{head.port}"


def test_a_head_ready_at_once_starts_the_others_too(run_tick, shard_report, two_nodes):
    # A starting report can be lost; the head's ready (or its answer to a resent start) is word enough.
    (head_node, _), (_, other_inbox) = two_nodes
    run_tick()
    head = Shard.objects.get(rank=0)
    shard_report(head_node, head, "ready", port=head.port)
    (start,) = other_inbox()
    assert start["rank"] == 1


def test_resending_starts_keeps_the_rank_order(run_tick, shard_report, two_nodes, settings):
    settings.LLMGW_START_RESEND_SECONDS = 10
    (head_node, _), (head_inbox, other_inbox) = two_nodes
    run_tick()
    (first,) = head_inbox()
    for command in PendingCommand.objects.all():
        acknowledge(command.node_name, command.cid)

    # The head's agent lost the start (it restarted): only the head's start is sent again.
    later = timezone.now() + timedelta(seconds=11)
    assert run_tick(now=later).starts_resent == 1
    assert head_inbox() == [first]
    assert other_inbox() == []

    head = Shard.objects.get(rank=0)
    shard_report(head_node, head, "starting")
    (start,) = other_inbox()
    acknowledge("gpu-b", PendingCommand.objects.get(node_name="gpu-b").cid)
    # The follower's agent lost its start: it is due again, its head having started.
    Shard.objects.filter(rank=1).update(updated_at=later)
    assert run_tick(now=later + timedelta(seconds=11)).starts_resent == 1
    assert other_inbox() == [start]


def test_the_heads_rendezvous_port_is_given_to_no_other_engine(run_tick, agent_inbox, two_nodes):
    make_model("small", gpus_per_node=1, nodes_per_replica=1)
    make_node("gpu-c", gpus=1, fabric="ib-a", address="10.0.0.1")  # shares the head's host, hence its ports
    run_tick()
    head = Shard.objects.get(replica__model__name="big", rank=0)
    small = Shard.objects.get(replica__model__name="small")
    assert small.node.name == "gpu-c"
    assert head.port == 20000
    assert small.port == 20002  # 20001 is the big replica's rendezvous

    # Read back from the rows on the next tick, too: a new replica there skips both.
    make_model("third", gpus_per_node=1, nodes_per_replica=1)
    make_node("gpu-d", gpus=1, fabric="ib-a", address="10.0.0.1")
    run_tick()
    assert Shard.objects.get(replica__model__name="third").port == 20003
    assert Shard.objects.filter(state=ShardState.ASSIGNED).count() == 4


def test_a_replica_spanning_nodes_drains_its_head_first_and_the_others_once_it_has_stopped(
    run_tick, shard_report, two_nodes, django_capture_on_commit_callbacks
):
    (head_node, other_node), (head_inbox, other_inbox) = two_nodes
    run_tick()
    head, other = Shard.objects.order_by("rank")
    for node, shard in ((head_node, head), (other_node, other)):
        shard_report(node, shard, "ready", port=shard.port)
    head_inbox(), other_inbox()
    for command in PendingCommand.objects.all():  # the agents have them
        acknowledge(command.node_name, command.cid)
    replica = Replica.objects.get(model__name="big")
    assert replica.state == ReplicaState.READY

    with django_capture_on_commit_callbacks(execute=True):
        stop_replica(replica)
    later = Replica.objects.get(pk=replica.pk).stopping_since + timedelta(seconds=unpublish_grace_seconds())
    assert run_tick(now=later).stops_sent == 1
    assert [(c["type"], c["shard_id"]) for c in head_inbox()] == [("drain_shard", head.pk)]
    # Requests still in flight on the head run through rank 1: it is left alone until the head has stopped.
    assert run_tick(now=later).stops_sent == 0
    assert other_inbox() == []

    shard_report(head_node, head, "stopped")
    assert run_tick(now=later).stops_sent == 1
    assert [(c["type"], c["shard_id"]) for c in other_inbox()] == [("drain_shard", other.pk)]
    shard_report(other_node, other, "stopped")
    assert not Replica.objects.filter(pk=replica.pk).exists()
