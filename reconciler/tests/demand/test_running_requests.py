"""Requests in flight per shard, as agents report them in heartbeats, and drain commands to agents."""

import json

import pytest
from django.db import transaction

from nodewire.parts import ShardHeartbeat
from nodewire.protocol import DrainShard, decode_command
from reconciler.agent_reports import record_running
from reconciler.models import Shard
from reconciler.outbox import Outbox
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


@pytest.fixture
def two_nodes():
    """Node a with two single-GPU replicas, node b with one."""
    a, b = make_node("gpu-a", gpus=2), make_node("gpu-b", gpus=1)
    profile = make_model("m", max_replicas=3).profiles.get()
    on_a = [make_replica(profile, placement=[(a, [i])]).shards.get() for i in range(2)]
    on_b = make_replica(profile, placement=[(b, [0])]).shards.get()
    return a, b, on_a, on_b


def running_by_shard() -> dict[int, int | None]:
    return dict(Shard.objects.values_list("pk", "running"))


def test_running_counts_are_stored_per_shard_and_unknown_stays_null(two_nodes):
    a, _, (first, second), on_b = two_nodes
    assert running_by_shard() == {first.pk: None, second.pk: None, on_b.pk: None}
    changed = record_running(
        a.pk,
        [
            ShardHeartbeat(shard_id=first.pk, state="ready", running=3),
            ShardHeartbeat(shard_id=second.pk, state="ready"),
        ],
    )
    assert changed == 1
    assert running_by_shard() == {first.pk: 3, second.pk: None, on_b.pk: None}


def test_a_node_reports_only_for_its_own_shards(two_nodes):
    a, b, (first, _), on_b = two_nodes
    record_running(b.pk, [ShardHeartbeat(shard_id=on_b.pk, state="ready", running=2)])
    # Node a claims node b's shard and an unknown id: neither is written.
    record_running(
        a.pk,
        [
            ShardHeartbeat(shard_id=on_b.pk, state="ready", running=9),
            ShardHeartbeat(shard_id=first.pk, state="ready", running=0),
            ShardHeartbeat(shard_id=999_999, state="ready", running=5),
        ],
    )
    running = running_by_shard()
    assert (running[on_b.pk], running[first.pk]) == (2, 0)
    assert 999_999 not in running


def test_a_shard_the_heartbeat_no_longer_mentions_becomes_unknown_not_idle(two_nodes):
    a, _, (first, second), _ = two_nodes
    record_running(
        a.pk,
        [
            ShardHeartbeat(shard_id=first.pk, state="ready", running=1),
            ShardHeartbeat(shard_id=second.pk, state="ready", running=0),
        ],
    )
    assert record_running(a.pk, [ShardHeartbeat(shard_id=first.pk, state="ready", running=1)]) == 1
    assert running_by_shard()[second.pk] is None


def test_recording_running_costs_one_read_and_at_most_one_write_whatever_the_node_runs(
    two_nodes, django_assert_num_queries
):
    a, _, shards, _ = two_nodes
    profile = shards[0].replica.profile
    big = make_node("gpu-big", gpus=8)
    on_big = [make_replica(profile, placement=[(big, [i])]).shards.get() for i in range(8)]
    busy = [ShardHeartbeat(shard_id=s.pk, state="ready", running=i + 1) for i, s in enumerate(on_big)]
    with django_assert_num_queries(2):
        assert record_running(big.pk, busy) == 8
    # Nothing changed: only the read.
    with django_assert_num_queries(1):
        assert record_running(big.pk, busy) == 0
    with django_assert_num_queries(2):
        assert record_running(a.pk, [ShardHeartbeat(shard_id=shards[0].pk, state="ready", running=4)]) == 1
    assert [Shard.objects.get(pk=s.pk).running for s in on_big] == list(range(1, 9))


def test_recording_running_leaves_updated_at_alone(two_nodes):
    """updated_at times start resends; a load report must not push a resend back."""
    a, _, (first, _), _ = two_nodes
    before = Shard.objects.get(pk=first.pk).updated_at
    record_running(a.pk, [ShardHeartbeat(shard_id=first.pk, state="ready", running=7)])
    assert Shard.objects.get(pk=first.pk).updated_at == before


def test_outbox_drain_sends_a_typed_drain_shard_after_commit(agent_inbox, django_capture_on_commit_callbacks):
    inbox = agent_inbox("gpu-a")
    with django_capture_on_commit_callbacks(execute=True), transaction.atomic():
        outbox = Outbox(epoch=7)
        outbox.drain("gpu-a", 42, 30)
        outbox.send_on_commit()
        assert inbox() == []  # nothing before commit
    [sent] = inbox()
    assert sent == {"type": "drain_shard", "v": 1, "epoch": 7, "shard_id": 42, "timeout_seconds": 30.0}
    # It is what the agent's gate accepts.
    assert decode_command(json.dumps(sent)) == DrainShard(epoch=7, shard_id=42, timeout_seconds=30.0)


@pytest.mark.parametrize("timeout", [-1, float("nan"), "30", None, True])
def test_outbox_drain_refuses_a_timeout_that_is_not_seconds(timeout):
    with pytest.raises(ValueError, match="drain timeout must be a number of seconds >= 0"):
        Outbox(epoch=1).drain("gpu-a", 42, timeout)
