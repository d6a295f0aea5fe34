"""shard_status reports applied in batches: one lookup for the batch, arrival order kept, each report on its own."""

import logging

import pytest
from django.db import DatabaseError

from nodewire.protocol import ShardStatus
from reconciler import agent_reports
from reconciler.agent_reports import record_shard_statuses
from reconciler.choices import ReplicaState, ShardState
from reconciler.models import Replica, Shard
from tests.fleet import make_model, make_node

pytestmark = pytest.mark.django_db

# Inside a test's transaction the batch's own is a savepoint: two statements a live process does not count.
BATCH_SAVEPOINT = 2


@pytest.fixture
def apply_batch(django_capture_on_commit_callbacks):
    """Apply (node, shard id, state[, fields]) reports as one batch and run what it sends after commit."""

    def apply(*reports):
        batch = [
            (node.pk, node.name, ShardStatus(shard_id=shard_id, state=state, **fields))
            for node, shard_id, state, *rest in reports
            for fields in [rest[0] if rest else {}]
        ]
        with django_capture_on_commit_callbacks(execute=True):
            record_shard_statuses(batch)

    return apply


def placed(run_tick, count: int) -> list[Shard]:
    """`count` single-GPU replicas of one model, placed (one shard each), ordered by id."""
    make_node("gpu-a", gpus=count)
    make_model("llama", min_replicas=count, max_replicas=count)
    run_tick()
    return list(Shard.objects.select_related("node").order_by("pk"))


def test_reports_about_shards_that_are_gone_cost_one_query_however_many(apply_batch, django_assert_num_queries, caplog):
    """A tick's burst of stops answered by a thousand nodes: nothing to change, one lookup for the batch."""
    nodes = [make_node(f"gpu-{i}") for i in range(20)]
    with (
        caplog.at_level(logging.INFO, logger="reconciler.agent_reports"),
        django_assert_num_queries(1 + BATCH_SAVEPOINT),
    ):
        apply_batch(*((node, 10_000 + i, "stopped") for i, node in enumerate(nodes)))
    assert caplog.text.count("but no such shard is on it; ignored") == 20


@pytest.mark.parametrize("count", [2, 6])
def test_each_report_costs_only_the_writes_it_makes(count, run_tick, apply_batch, django_assert_num_queries):
    """One lookup, then per report its savepoint, its UPDATE and the savepoint's release."""
    shards = placed(run_tick, count)
    with django_assert_num_queries(1 + 3 * count + BATCH_SAVEPOINT):
        apply_batch(*((shard.node, shard.pk, "starting") for shard in shards))
    assert set(Shard.objects.values_list("state", flat=True)) == {ShardState.STARTING}


def test_reports_of_one_shard_apply_in_the_order_they_arrived(run_tick, apply_batch):
    first, second = placed(run_tick, 2)

    apply_batch(
        (first.node, first.pk, "starting"),
        (first.node, first.pk, "ready", {"port": first.port}),
        (second.node, second.pk, "ready", {"port": second.port}),
        (second.node, second.pk, "stopped"),
        (second.node, second.pk, "ready", {"port": second.port}),  # after its stop: no such shard any more
    )

    first_replica = Replica.objects.get(pk=first.replica_id)
    assert (Shard.objects.get(pk=first.pk).state, first_replica.state) == (ShardState.READY, ReplicaState.READY)
    assert not Shard.objects.filter(pk=second.pk).exists()
    # Stopped while it served, by nobody's order: its node is at fault, so it is placed again at once.
    second_replica = Replica.objects.get(pk=second.replica_id)
    assert (second_replica.state, second_replica.last_error) == (
        ReplicaState.PENDING,
        f"shard {second.pk} stopped on gpu-a",
    )


def test_a_report_after_another_changed_its_replica_sees_the_change(run_tick, apply_batch, agent_inbox, caplog):
    """The worker fails the two-node replica (its head's row goes); the head's "ready" of the same batch is moot."""
    make_node("gpu-a", gpus=2, fabric="ib-a")
    make_node("gpu-b", gpus=2, fabric="ib-a")
    make_model("big", gpus_per_node=2, nodes_per_replica=2)
    run_tick()
    head, worker = Shard.objects.select_related("node").order_by("rank")
    inbox_head = agent_inbox(head.node.name)

    with caplog.at_level(logging.INFO, logger="reconciler.agent_reports"):
        apply_batch(
            (worker.node, worker.pk, "failed", {"message": "CUDA out of memory"}),
            (head.node, head.pk, "ready", {"port": head.port}),
        )

    replica = Replica.objects.get()
    assert (replica.state, replica.last_error) == (ReplicaState.FAILED, "CUDA out of memory")
    assert inbox_head() == [{"type": "stop_shard", "v": 1, "epoch": 1, "shard_id": head.pk}]
    assert f"reported shard {head.pk} as ready, but no such shard is on it; ignored" in caplog.text
    assert "ERROR" not in caplog.text


def test_a_node_speaks_only_for_its_own_shards(run_tick, apply_batch):
    first, second = placed(run_tick, 2)
    stranger = make_node("gpu-z")

    apply_batch((stranger, first.pk, "failed"), (second.node, second.pk, "starting"))

    assert Shard.objects.get(pk=first.pk).state == ShardState.ASSIGNED
    assert Shard.objects.get(pk=second.pk).state == ShardState.STARTING


def test_a_report_that_fails_to_apply_is_undone_alone_and_sends_nothing(
    run_tick, apply_batch, agent_inbox, monkeypatch, caplog
):
    first, second = placed(run_tick, 2)
    inbox = agent_inbox("gpu-a")
    original = agent_reports._apply_shard_status

    def fails_for_the_first(shard, *args, **kwargs):
        wake = original(shard, *args, **kwargs)  # its writes and commands are made, then the database refuses
        if shard.pk == first.pk:
            raise DatabaseError("could not serialize access")
        return wake

    monkeypatch.setattr(agent_reports, "_apply_shard_status", fails_for_the_first)
    apply_batch((first.node, first.pk, "failed", {"message": "boom"}), (second.node, second.pk, "starting"))

    assert Shard.objects.get(pk=first.pk).state == ShardState.ASSIGNED
    assert Replica.objects.get(pk=first.replica_id).state == ReplicaState.STARTING
    assert Shard.objects.get(pk=second.pk).state == ShardState.STARTING
    assert inbox() == []  # the failed report's stop of its replica's shards was undone with it
    assert f"could not record node gpu-a's report of shard {first.pk} as failed" in caplog.text
