"""The beat-driven tick task, run by a real Celery worker over the real Redis broker."""

import threading

import pytest
from celery.contrib.testing.worker import start_worker
from celery.signals import task_postrun

from llmgw_site.celery import app
from reconciler.choices import ReplicaState
from reconciler.models import Replica
from reconciler.tasks import tick
from tests.fleet import make_model, make_node


@pytest.mark.django_db(transaction=True)
def test_tick_task_run_by_a_worker_places_a_min_replica(redis_broker):
    make_node("gpu-a")
    model = make_model("llama")

    done = threading.Event()

    def finished(sender=None, **kwargs):
        if sender is not None and sender.name == "reconciler.tasks.tick":
            done.set()

    task_postrun.connect(finished, weak=False)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=5):
            tick.delay()
            # Wait for the worker's own signal rather than polling the rows it is writing.
            assert done.wait(timeout=10), "the worker did not run the tick"
    finally:
        task_postrun.disconnect(finished)

    replica = Replica.objects.get(model=model)
    assert replica.state == ReplicaState.STARTING
    assert replica.shards.count() == 1


@pytest.mark.django_db
def test_tick_task_logs_a_failing_tick_instead_of_raising(monkeypatch, caplog):
    def broken(**kwargs):
        raise RuntimeError("database on fire")

    monkeypatch.setattr("reconciler.tasks.run_tick", broken)
    tick.run()
    assert "reconcile tick failed" in caplog.text
