"""Failed shards and replicas: backoff, retries, start timeouts and resends."""

from datetime import timedelta

import pytest
from django.utils import timezone

from reconciler.choices import ReplicaState
from reconciler.lifecycle import backoff_seconds
from reconciler.models import GPUAssignment, Replica, Shard
from tests.fleet import make_model, make_node

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


def test_an_unanswered_start_is_sent_again(run_tick, agent_inbox, settings):
    settings.LLMGW_START_RESEND_SECONDS = 10
    make_node("gpu-a")
    make_model("llama")
    inbox = agent_inbox("gpu-a")
    run_tick()
    (first,) = inbox()

    assert run_tick(now=timezone.now() + timedelta(seconds=5)).starts_resent == 0
    assert run_tick(now=timezone.now() + timedelta(seconds=11)).starts_resent == 1
    assert inbox() == [first]
