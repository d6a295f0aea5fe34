"""Demand: activations, disabled models, max replicas and idle scale-down."""

from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from catalog.models import Alias, Model
from hub import get_hub
from reconciler.choices import ReplicaState
from reconciler.models import Replica, Shard
from tests.fleet import make_model, make_node, ready_replicas

pytestmark = pytest.mark.django_db


def test_activation_creates_exactly_one_replica(run_tick):
    make_node("gpu-a")
    model = make_model("llama", min_replicas=0, max_replicas=3)
    Alias.objects.create(model=model, name="llama-latest")
    hub = get_hub()
    for name in ("llama", "llama", "llama-latest"):
        async_to_sync(hub.request_activation)(name)

    assert run_tick().replicas_created == 1
    async_to_sync(hub.request_activation)("llama")
    assert run_tick().replicas_created == 0
    assert Replica.objects.filter(model=model).count() == 1


def test_activation_of_an_unknown_model_creates_nothing(run_tick):
    async_to_sync(get_hub().request_activation)("nope")
    result = run_tick()
    assert result.unknown_activations == ["nope"]
    assert Replica.objects.count() == 0


def test_disabled_model_replicas_are_stopped(run_tick, agent_inbox):
    make_node("gpu-a")
    model = make_model("llama")
    run_tick()
    shard = Shard.objects.get()
    inbox = agent_inbox("gpu-a")
    Model.objects.filter(pk=model.pk).update(enabled=False)

    result = run_tick()

    assert result.replicas_stopped == 1
    replica = Replica.objects.get()
    assert (replica.state, replica.stop_reason) == (ReplicaState.STOPPING, "model disabled")
    # Unpublished first; the drain goes out once routers have had time to stop sending to it.
    assert inbox() == []
    run_tick(now=timezone.now() + timedelta(seconds=2))
    assert [(c["type"], c["shard_id"]) for c in inbox()] == [("drain_shard", shard.pk)]


def test_replicas_above_max_are_stopped_pending_first(run_tick):
    model = make_model("llama", min_replicas=0, max_replicas=1)
    profile = model.profiles.get()
    Replica.objects.bulk_create(Replica(model=model, profile=profile) for _ in range(3))

    result = run_tick()

    assert result.replicas_deleted == 2
    assert Replica.objects.count() == 1


def test_replicas_idle_past_the_timeout_are_stopped_down_to_min(run_tick, usage_known):
    model = make_model("llama", min_replicas=2, max_replicas=3, idle_timeout_seconds=600)
    busy, idlest, idle = ready_replicas(model, [30, 3600, 900])

    result = run_tick()

    assert result.replicas_idle_stopped == 1
    assert set(Replica.objects.values_list("pk", flat=True)) == {busy.pk, idle.pk}


def test_a_replica_whose_last_use_is_unknown_is_never_stopped_for_idleness(run_tick, usage_known):
    """DESIGN invariant 3: unknown is not idle."""
    model = make_model("llama", min_replicas=0, max_replicas=2, idle_timeout_seconds=60)
    unknown, idle = ready_replicas(model, [None, 120])

    result = run_tick()

    assert result.replicas_idle_stopped == 1
    assert list(Replica.objects.values_list("pk", flat=True)) == [unknown.pk]


def test_an_idle_timeout_of_zero_means_replicas_stay(run_tick):
    model = make_model("llama", min_replicas=0, max_replicas=1, idle_timeout_seconds=0)
    ready_replicas(model, [10**6])

    assert run_tick().replicas_idle_stopped == 0
    assert Replica.objects.count() == 1


@pytest.mark.parametrize(("idle", "stopped"), [(1799, 0), (1801, 1)])
def test_an_empty_idle_timeout_is_the_fleet_default_so_a_model_can_go_back_to_zero(
    run_tick, usage_known, settings, idle, stopped
):
    settings.LLMGW_DEFAULT_IDLE_TIMEOUT_SECONDS = 1800
    model = make_model("llama", min_replicas=0, max_replicas=1, idle_timeout_seconds=None)
    ready_replicas(model, [idle])

    assert run_tick().replicas_idle_stopped == stopped
