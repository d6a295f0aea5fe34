"""Profiles tried in order (fallback), each profile's own max, and scale-out on the routers' load."""

from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from catalog.models import Profile
from hub import get_hub
from reconciler.choices import ReplicaState
from reconciler.demand.scaling import apply_demand
from reconciler.models import ModelLoad, Replica, Shard
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db

L40S = "L40S-48GB"


def with_fallback(name, *, min_replicas=0, max_replicas=2, fallback_max=1):
    """A model wanting a whole 8×H100 node first, and two L40S GPUs as its fallback."""
    model = make_model(name, gpus_per_node=8, min_replicas=min_replicas, max_replicas=max_replicas)
    Profile.objects.create(model=model, order=1, gpu_class=L40S, gpus_per_node=2, max_replicas=fallback_max)
    return model


def test_a_model_whose_first_gpu_class_is_full_runs_on_its_next_profile(run_tick):
    make_node("gpu-a", gpus=4)  # too small for the 8-GPU profile
    make_node("gpu-c", gpus=4, gpu_class=L40S)
    model = with_fallback("llama", min_replicas=1)

    run_tick()

    replica = Replica.objects.get(model=model)
    assert replica.state == ReplicaState.STARTING
    assert replica.profile.gpu_class == L40S
    assert Shard.objects.get(replica=replica).node.name == "gpu-c"


def test_the_unplaceable_reason_covers_every_profile(run_tick):
    make_node("gpu-a", gpus=4)
    make_node("gpu-c", gpus=1, gpu_class=L40S)
    model = with_fallback("llama")
    async_to_sync(get_hub().request_activation)("llama")

    run_tick()

    assert Replica.objects.get(model=model).placement_note == (
        "H100-80GB×8: needs 8×H100-80GB on one node; most free on one node: 4 (gpu-a); "
        "L40S-48GB×2: needs 2×L40S-48GB on one node; most free on one node: 1 (gpu-c)"
    )


def test_a_fallback_profile_at_its_own_max_takes_no_more(run_tick):
    make_node("gpu-c", gpus=8, gpu_class=L40S)
    model = with_fallback("llama", min_replicas=2, max_replicas=2, fallback_max=1)

    run_tick()

    states = sorted(Replica.objects.filter(model=model).values_list("state", flat=True))
    assert states == [ReplicaState.PENDING, ReplicaState.STARTING]
    assert "L40S-48GB×2: at its max of 1" in Replica.objects.get(state=ReplicaState.PENDING).placement_note


def busy_model(target=4):
    node = make_node("gpu-a")
    model = make_model("llama", min_replicas=1, max_replicas=3, target_concurrency=target)
    make_replica(model.profiles.get(), placement=[(node, [0])], last_used=timezone.now())
    return model


def test_load_above_target_that_lasts_adds_one_replica(settings):
    settings.LLMGW_SCALE_OUT_AFTER_SECONDS = 30
    model = busy_model(target=4)
    start = timezone.now()

    assert apply_demand(set(), start, in_flight={"llama": 9}).scaled_out == 0
    assert ModelLoad.objects.get(model=model).busy_since == start
    assert apply_demand(set(), start + timedelta(seconds=10), in_flight={"llama": 9}).scaled_out == 0
    outcome = apply_demand(set(), start + timedelta(seconds=31), in_flight={"llama": 9})

    assert outcome.scaled_out == 1
    assert Replica.objects.filter(model=model, state=ReplicaState.PENDING).count() == 1
    # While that one is coming, no other is added for the same load.
    assert apply_demand(set(), start + timedelta(seconds=90), in_flight={"llama": 9}).scaled_out == 0


def test_load_that_drops_below_target_resets_the_wait(settings):
    settings.LLMGW_SCALE_OUT_AFTER_SECONDS = 30
    model = busy_model(target=4)
    start = timezone.now()
    apply_demand(set(), start, in_flight={"llama": 9})
    apply_demand(set(), start + timedelta(seconds=20), in_flight={"llama": 3})
    assert ModelLoad.objects.get(model=model).busy_since is None

    assert apply_demand(set(), start + timedelta(seconds=40), in_flight={"llama": 9}).scaled_out == 0


def test_scale_out_stops_at_max_replicas(settings):
    settings.LLMGW_SCALE_OUT_AFTER_SECONDS = 0
    model = busy_model(target=1)
    profile = model.profiles.get()
    Profile.objects.filter(pk=profile.pk).update(max_replicas=1)

    assert apply_demand(set(), timezone.now(), in_flight={"llama": 50}).scaled_out == 0
    assert Replica.objects.filter(model=model).count() == 1


def test_unknown_load_leaves_the_record_alone(settings):
    model = busy_model(target=4)
    apply_demand(set(), timezone.now(), in_flight={"llama": 9})
    before = ModelLoad.objects.get(model=model).busy_since

    apply_demand(set(), timezone.now(), in_flight=None)

    assert ModelLoad.objects.get(model=model).busy_since == before


def test_idle_stops_wait_while_usage_is_unknown():
    model = make_model("llama", min_replicas=0, idle_timeout_seconds=60)
    make_replica(model.profiles.get(), last_used=timezone.now() - timedelta(hours=5))

    assert apply_demand(set(), timezone.now(), usage_known=False).idle_stopped == 0
    assert apply_demand(set(), timezone.now(), usage_known=True).idle_stopped == 1


def test_a_replica_whose_engine_reports_running_requests_is_not_stopped_for_idleness():
    node = make_node("gpu-a")
    model = make_model("llama", min_replicas=0, idle_timeout_seconds=60)
    replica = make_replica(model.profiles.get(), placement=[(node, [0])], last_used=timezone.now() - timedelta(hours=5))
    Shard.objects.filter(replica=replica).update(running=3)

    assert apply_demand(set(), timezone.now()).idle_stopped == 0
