"""Stopping replicas, and what an agent's hello says about the shards it runs."""

import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from conftest import wait_until
from hub import get_hub
from inventory.models import Node
from nodewire.parts import RunningShard
from reconciler.agent_reports import reconcile_reported_shards_of_nodes
from reconciler.choices import ReplicaState, ShardState
from reconciler.commands import acknowledge, send_pending_soon_to
from reconciler.endpoints import build_endpoint_table
from reconciler.lifecycle.transitions import stop_replica, unpublish_grace_seconds
from reconciler.models import GPUAssignment, PendingCommand, Replica, Shard
from reconciler.signals import work_pending
from tests.fleet import make_model, make_node

pytestmark = pytest.mark.django_db


def test_stopping_a_replica_drains_it_once_unpublished_and_deletes_it_when_its_shards_stop(
    run_tick, agent_inbox, django_capture_on_commit_callbacks, shard_report
):
    node = make_node("gpu-a")
    make_model("llama", min_replicas=0)
    async_to_sync(get_hub().request_activation)("llama")
    run_tick()
    replica, shard = Replica.objects.get(), Shard.objects.get()
    inbox = agent_inbox("gpu-a")

    with django_capture_on_commit_callbacks(execute=True):
        stop_replica(replica)
    stopping = Replica.objects.get()
    assert (stopping.state, stopping.endpoint_url) == (ReplicaState.STOPPING, "")
    assert stopping.stop_reason == "stopped by an operator"
    assert build_endpoint_table().endpoints == []
    grace = unpublish_grace_seconds()
    run_tick(now=stopping.stopping_since + timedelta(seconds=grace / 2))
    assert inbox() == []  # routers may not have the table without it yet
    later = stopping.stopping_since + timedelta(seconds=grace)
    assert run_tick(now=later).stops_sent == 1
    assert [(c["type"], c["shard_id"]) for c in inbox()] == [("drain_shard", shard.pk)]
    assert run_tick(now=later).stops_sent == 0
    # Acknowledged, it is under way on the agent: not sent again, however long the engine takes.
    assert acknowledge("gpu-a", PendingCommand.objects.get(kind="drain_shard").cid)
    assert run_tick(now=later + timedelta(seconds=60)).stops_sent == 0
    assert inbox() == []

    shard_report(node, shard, "stopped")
    assert Replica.objects.count() == 0 and GPUAssignment.objects.count() == 0


def test_stopping_a_replica_without_shards_deletes_it_at_once():
    model = make_model("llama")
    replica = Replica.objects.create(model=model, profile=model.profiles.get())
    stop_replica(replica)
    assert Replica.objects.count() == 0


def test_agent_hello_keeps_known_shards_stops_orphans_and_fails_missing_ones(
    run_tick, agent_inbox, django_capture_on_commit_callbacks
):
    node = make_node("gpu-a")
    make_model("kept")
    make_model("gone")
    run_tick()
    kept = Shard.objects.get(replica__model__name="kept")
    gone = Shard.objects.get(replica__model__name="gone")
    Shard.objects.filter(pk=gone.pk).update(state=ShardState.STARTING)  # the agent had begun starting it
    inbox = agent_inbox("gpu-a")

    with django_capture_on_commit_callbacks(execute=True):
        reconcile_reported_shards_of_nodes(
            [
                (
                    node,
                    [
                        RunningShard(shard_id=kept.pk, replica_id=kept.replica_id, state="ready", port=kept.port),
                        RunningShard(shard_id=424242, replica_id=7, state="ready", port=29999),
                    ],
                )
            ]
        )

    assert Replica.objects.get(model__name="kept").state == ReplicaState.READY
    failed = Replica.objects.get(model__name="gone")
    assert not Shard.objects.filter(pk=gone.pk).exists()
    # The agent lost its engines (it restarted): the node's doing, so placed again without backoff.
    assert (failed.state, failed.failure_count) == (ReplicaState.PENDING, 0)
    assert inbox() == [{"type": "stop_shard", "v": 1, "epoch": 1, "shard_id": 424242}]


def test_a_start_the_agent_never_answered_is_sent_again_after_its_hello_not_failed(
    run_tick, agent_inbox, django_capture_on_commit_callbacks
):
    """The start may have been sent while the agent was between connections."""
    node = make_node("gpu-a")
    make_model("llama")
    run_tick()
    shard = Shard.objects.get()
    assert shard.state == ShardState.ASSIGNED
    inbox = agent_inbox("gpu-a")

    with django_capture_on_commit_callbacks(execute=True):
        # What agentlink.services.on_hellos does with a hello that lists no shards.
        reconcile_reported_shards_of_nodes([(node, [])])
        send_pending_soon_to([node.name], timezone.now())
    assert run_tick().commands_resent == 1

    replica = Replica.objects.get()
    assert replica.state == ReplicaState.STARTING and replica.failure_count == 0
    assert [(c["type"], c["shard_id"]) for c in inbox()] == [("start_shard", shard.pk)]


def test_the_ticker_is_told_when_a_stopping_replicas_unpublish_grace_has_passed(django_capture_on_commit_callbacks):
    """So the drain is sent then, not up to a tick interval later (the embedded runner ticks on work_pending)."""
    make_node("gpu-a")
    model = make_model("llama", min_replicas=0)
    replica = Replica.objects.create(model=model, profile=model.profiles.get(), state=ReplicaState.READY)
    Shard.objects.create(replica=replica, node=Node.objects.get(), rank=0, port=20000, state=ShardState.READY)
    told = []

    def receiver(**_kwargs):
        told.append(time.monotonic())

    work_pending.connect(receiver, weak=False, dispatch_uid="grace-test")
    try:
        began = time.monotonic()
        with django_capture_on_commit_callbacks(execute=True):
            stop_replica(replica)
        wait_until(lambda: [t for t in told if t - began >= unpublish_grace_seconds()], 5, 0.02)
    finally:
        work_pending.disconnect(dispatch_uid="grace-test")
