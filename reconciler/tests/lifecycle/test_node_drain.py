"""Node drain, make-before-break: a serving replica keeps serving until its replacement elsewhere is ready,
then it is drained; at once (saying why) when there is no room for a replacement or the wait runs out."""

from datetime import timedelta

import pytest
from django.utils import timezone

from reconciler.choices import ReplicaState
from reconciler.endpoints import build_endpoint_table
from reconciler.lifecycle.drain import drain_nodes, drain_replaced
from reconciler.lifecycle.transitions import unpublish_grace_seconds
from reconciler.models import Replica, Shard
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


def endpoints() -> set[str]:
    return {e.url for e in build_endpoint_table().endpoints}


def test_replica_on_a_drained_node_serves_until_its_replacement_is_ready_then_gets_drain_shard(
    run_tick, agent_inbox, shard_report
):
    a, b = make_node("gpu-a", gpus=2), make_node("gpu-b", gpus=2)
    inbox = {"gpu-a": agent_inbox("gpu-a"), "gpu-b": agent_inbox("gpu-b")}
    profile = make_model("llama", min_replicas=1, max_replicas=1).profiles.get()
    old = make_replica(profile, placement=[(a, [0])], endpoint="http://127.0.0.1:21001")

    assert drain_nodes([a.pk]) == (1, 1)
    old.refresh_from_db()
    assert old.state == ReplicaState.READY and old.replaced_by is not None
    assert old.stop_reason == f"node drained: serving until replica {old.replaced_by_id} is ready"
    new = old.replaced_by

    # The tick places the replacement on the other node (the model's max of 1 does not count the old one).
    run_tick()
    new.refresh_from_db()
    assert new.state == ReplicaState.STARTING
    assert new.shards.get().node == b
    assert [c["type"] for c in inbox["gpu-b"]()] == ["start_shard"]
    old.refresh_from_db()
    assert old.state == ReplicaState.READY and "http://127.0.0.1:21001" in endpoints()

    # Still starting: the old one keeps serving, tick after tick.
    run_tick()
    assert Replica.objects.get(pk=old.pk).state == ReplicaState.READY
    assert inbox["gpu-a"]() == []

    # Ready: the next tick takes the old one out of the table, and then drains it.
    shard_report(b, new.shards.get(), "ready", port=new.shards.get().port)
    assert Replica.objects.get(pk=new.pk).state == ReplicaState.READY
    report = run_tick()
    old.refresh_from_db()
    assert report.replicas_replaced == 1
    assert (old.state, old.stop_reason) == (ReplicaState.STOPPING, f"node drained: replaced by replica {new.pk}")
    assert "http://127.0.0.1:21001" not in endpoints()
    run_tick(now=timezone.now() + timedelta(seconds=unpublish_grace_seconds() + 1))
    drains = inbox["gpu-a"]()
    assert [(c["type"], c["shard_id"]) for c in drains] == [("drain_shard", old.shards.get().pk)]
    assert Replica.objects.get(pk=new.pk).state == ReplicaState.READY


def test_no_room_elsewhere_drains_at_once_with_a_note_and_withdraws_the_replacement(run_tick, agent_inbox):
    a = make_node("gpu-a", gpus=2)
    make_node("gpu-b", gpus=1, gpu_class="L4-24GB")  # another class: no room for this model
    inbox = agent_inbox("gpu-a")
    profile = make_model("llama", min_replicas=1, max_replicas=1).profiles.get()
    old = make_replica(profile, placement=[(a, [0])], endpoint="http://127.0.0.1:21002")
    drain_nodes([a.pk])
    replacement = Replica.objects.get(pk=old.pk).replaced_by_id

    report = run_tick()
    old.refresh_from_db()
    assert report.replicas_replaced == 1
    assert old.state == ReplicaState.STOPPING
    assert old.stop_reason.startswith("node drained: no room for a replacement (")
    assert not Replica.objects.filter(pk=replacement).exists()
    run_tick(now=timezone.now() + timedelta(seconds=unpublish_grace_seconds() + 1))
    assert [c["type"] for c in inbox()] == ["drain_shard"]


def test_a_replacement_not_ready_in_time_lets_the_drain_go_ahead(run_tick, settings):
    settings.LLMGW_DRAIN_REPLACEMENT_WAIT_SECONDS = 60
    a, _ = make_node("gpu-a", gpus=2), make_node("gpu-b", gpus=2)
    profile = make_model("llama", min_replicas=1, max_replicas=1).profiles.get()
    old = make_replica(profile, placement=[(a, [0])], endpoint="http://127.0.0.1:21003")
    drain_nodes([a.pk])
    run_tick()
    assert Replica.objects.get(pk=old.pk).state == ReplicaState.READY
    run_tick(now=timezone.now() + timedelta(seconds=61))
    old.refresh_from_db()
    new_pk = Replica.objects.exclude(pk=old.pk).get().pk
    assert (old.state, old.stop_reason) == (
        ReplicaState.STOPPING,
        f"node drained: replica {new_pk} was not ready within 60 s",
    )


def test_replicas_not_serving_yet_are_stopped_at_once_and_a_zero_wait_keeps_the_old_drain(settings):
    a = make_node("gpu-a", gpus=4)
    profile = make_model("llama", min_replicas=0, max_replicas=4).profiles.get()
    starting = make_replica(profile, state=ReplicaState.STARTING, placement=[(a, [0])])
    assert drain_nodes([a.pk]) == (1, 1)
    assert Replica.objects.get(pk=starting.pk).state == ReplicaState.STOPPING

    settings.LLMGW_DRAIN_REPLACEMENT_WAIT_SECONDS = 0
    b = make_node("gpu-b", gpus=4)
    ready = make_replica(profile, placement=[(b, [0])], endpoint="http://127.0.0.1:21004")
    drain_nodes([b.pk])
    assert Replica.objects.get(pk=ready.pk).state == ReplicaState.STOPPING
    assert Replica.objects.count() == 2  # no replacement


@pytest.mark.parametrize("count", [1, 6])
def test_draining_replaced_replicas_takes_a_constant_number_of_queries(count, django_assert_num_queries):
    nodes = [make_node(f"gpu-{i}", gpus=1) for i in range(count)]
    profile = make_model("llama", min_replicas=0, max_replicas=20).profiles.get()
    olds = [make_replica(profile, placement=[(n, [0])], endpoint=f"http://h{i}") for i, n in enumerate(nodes)]
    drain_nodes([n.pk for n in nodes])
    Replica.objects.filter(
        pk__in=[o.replaced_by_id for o in Replica.objects.filter(pk__in=[o.pk for o in olds])]
    ).update(state=ReplicaState.READY)
    # One read, then stop_replicas: one read of shards and one bulk update.
    with django_assert_num_queries(3):
        assert drain_replaced(timezone.now(), set()) == count
    assert set(Shard.objects.filter(replica__state=ReplicaState.STOPPING).values_list("replica_id", flat=True)) == {
        o.pk for o in olds
    }
