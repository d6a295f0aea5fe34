"""Failed shards and replicas: backoff, retries, start timeouts and resends."""

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from inventory.models import Node
from reconciler.choices import ReplicaState
from reconciler.commands import acknowledge
from reconciler.lifecycle.transitions import backoff_seconds, fail_replicas
from reconciler.models import BusyPort, GPUAssignment, PendingCommand, Replica, Shard
from reconciler.outbox import Outbox
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


def test_backoff_doubles_from_the_base_up_to_the_cap(settings):
    settings.LLMGW_BACKOFF_BASE_SECONDS, settings.LLMGW_BACKOFF_MAX_SECONDS = 5, 300
    assert [backoff_seconds(n) for n in (1, 2, 3, 7, 1000)] == [5, 10, 20, 300, 300]


def test_failed_shard_fails_the_replica_with_backoff_and_stops_its_other_shards(
    run_tick, agent_inbox, django_capture_on_commit_callbacks, shard_report
):
    make_node("gpu-a", gpus=2, fabric="ib-a")
    make_node("gpu-b", gpus=2, fabric="ib-a")
    make_model("big", gpus_per_node=2, nodes_per_replica=2)
    run_tick()
    head, worker = Shard.objects.select_related("node").order_by("rank")
    inbox_a, inbox_b = agent_inbox("gpu-a"), agent_inbox("gpu-b")

    before = timezone.now()
    shard_report(worker.node, worker, "failed", message="CUDA out of memory")

    replica = Replica.objects.get()
    assert (replica.state, replica.failure_count, replica.last_error) == (
        ReplicaState.FAILED,
        1,
        "CUDA out of memory",
    )
    assert before + timedelta(seconds=5) <= replica.next_attempt_at <= timezone.now() + timedelta(seconds=5)
    assert Shard.objects.count() == 0 and GPUAssignment.objects.count() == 0
    assert inbox_a() == [{"type": "stop_shard", "v": 1, "epoch": 1, "shard_id": head.pk}]
    assert inbox_b() == []


def test_failed_replica_waits_for_its_backoff_then_is_placed_again(
    run_tick, django_capture_on_commit_callbacks, shard_report
):
    node = make_node("gpu-a")
    make_model("llama")
    run_tick()
    shard_report(node, Shard.objects.get(), "failed", message="boom")
    failed_at = timezone.now()

    early = run_tick(now=failed_at + timedelta(seconds=1))
    assert (early.replicas_created, early.replicas_retried) == (0, 0)
    assert Replica.objects.get().state == ReplicaState.FAILED

    later = run_tick(now=failed_at + timedelta(seconds=6))
    assert (later.replicas_retried, later.replicas_placed) == (1, 1)
    replica = Replica.objects.get()
    assert replica.state == ReplicaState.STARTING

    shard_report(node, replica.shards.get(), "failed", message="boom")
    replica.refresh_from_db()
    assert replica.failure_count == 2
    assert replica.next_attempt_at >= timezone.now() + timedelta(seconds=9)


def test_a_shard_that_never_starts_fails_its_replica(run_tick, settings):
    settings.LLMGW_SHARD_START_TIMEOUT_SECONDS = 60
    make_node("gpu-a")
    make_model("llama")
    run_tick()

    result = run_tick(now=timezone.now() + timedelta(seconds=61))

    assert result.replicas_failed == 1
    assert Replica.objects.get().last_error == "not ready within 60 s of placement"


def test_an_acknowledged_start_never_answered_is_sent_again(run_tick, agent_inbox, settings):
    """The backstop behind acks: the agent had the start and lost it (it restarted before the engine began)."""
    settings.LLMGW_START_RESEND_SECONDS = 10
    make_node("gpu-a")
    make_model("llama")
    inbox = agent_inbox("gpu-a")
    run_tick()
    (first,) = inbox()
    acknowledge("gpu-a", PendingCommand.objects.get().cid)

    assert run_tick(now=timezone.now() + timedelta(seconds=5)).starts_resent == 0
    assert run_tick(now=timezone.now() + timedelta(seconds=11)).starts_resent == 1
    assert inbox() == [first]


def test_a_replica_ready_for_a_while_starts_its_failure_count_afresh(run_tick, settings):
    settings.LLMGW_BACKOFF_RESET_SECONDS = 120
    node = make_node("gpu-a")
    profile = make_model("llama", min_replicas=2, max_replicas=2).profiles.get()
    stable = make_replica(profile, placement=[(node, [0])])
    young = make_replica(profile, placement=[(node, [1])])
    now = timezone.now()
    Replica.objects.filter(pk=stable.pk).update(failure_count=4, ready_at=now - timedelta(seconds=121))
    Replica.objects.filter(pk=young.pk).update(failure_count=4, ready_at=now - timedelta(seconds=60))

    run_tick(now=now)

    assert Replica.objects.get(pk=stable.pk).failure_count == 0
    assert Replica.objects.get(pk=young.pk).failure_count == 4


def test_an_engine_the_agent_stopped_on_its_own_is_placed_again_without_backoff(run_tick, shard_report):
    """An agent shutting down stops its engines: the replica did nothing wrong."""
    node = make_node("gpu-a")
    make_model("llama")
    run_tick()
    Replica.objects.update(last_used=timezone.now())
    shard_report(node, Shard.objects.get(), "stopped", message="engine exited with code 0")

    replica = Replica.objects.get()
    assert (replica.state, replica.failure_count, replica.last_used) == (ReplicaState.PENDING, 0, None)
    assert run_tick().replicas_placed == 1


def test_a_busy_port_costs_one_failed_start_and_is_avoided_until_it_expires(run_tick, shard_report, settings):
    settings.LLMGW_ENGINE_PORT_RANGE, settings.LLMGW_BUSY_PORT_SECONDS = (20000, 20009), 600
    node = make_node("gpu-a")
    make_model("llama")
    run_tick()
    first = Shard.objects.get()
    assert first.port == 20000

    shard_report(node, first, "failed", message="port 20000 is already in use", port=20000, port_busy=True)

    replica = Replica.objects.get()
    assert (replica.state, replica.failure_count) == (ReplicaState.PENDING, 0)  # the node's problem: no backoff
    assert list(BusyPort.objects.values_list("node__name", "port")) == [("gpu-a", 20000)]
    assert run_tick().replicas_placed == 1
    assert Shard.objects.get().port == 20001  # never the busy port again while it is marked

    Shard.objects.all().delete()
    Replica.objects.update(state=ReplicaState.PENDING)
    later = timezone.now() + timedelta(seconds=601)
    Node.objects.update(last_seen=later)  # still heard from, ten minutes on
    run_tick(now=later)
    assert Shard.objects.get().port == 20000  # the mark expired: the port may have been freed


@pytest.mark.django_db(transaction=True)
def test_concurrent_failures_of_one_replica_both_count():
    """No lost update: a second failure decided while the first is uncommitted still counts."""
    node = make_node("gpu-a")
    replica = make_replica(make_model("llama").profiles.get(), placement=[(node, [0])])
    first_decided, errors = threading.Event(), []

    def fail(hold: float, wait_for: threading.Event | None):
        try:
            if wait_for is not None:
                wait_for.wait(timeout=5)
            with transaction.atomic():
                fail_replicas([replica.pk], "boom", timezone.now(), Outbox(epoch=1))
                first_decided.set()
                time.sleep(hold)  # the other failure is decided meanwhile
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=fail, args=(0.3, None)), threading.Thread(target=fail, args=(0, first_decided))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert errors == []
    assert Replica.objects.get().failure_count == 2
