"""How many replicas would a load need: objective scaling's rule at a multiple of the load the routers see now."""

from datetime import timedelta

import pytest
from django.utils import timezone

from reconciler.models import ModelLoad, Replica
from reconciler.planner.load import replicas_for_load
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


def fleet(name="llama", *, ready=2, max_replicas=8, **profile):
    node = make_node(f"gpu-{name}")
    model = make_model(name, min_replicas=1, max_replicas=max_replicas)
    model.profiles.update(**profile)
    for gpu in range(ready):
        make_replica(model.profiles.get(), placement=[(node, [gpu])])
    Replica.objects.filter(model=model).update(ready_at=timezone.now() - timedelta(hours=1))
    return model


def test_with_objectives_the_worst_p90_over_its_objective_scales_with_the_load(settings):
    settings.LLMGW_OBJECTIVE_SCALE_UP = 0.9
    model = fleet(ttft_objective_seconds=0.5, itl_objective_seconds=0.05)
    ModelLoad.objects.create(model=model, ttft_p90=0.6, itl_p90=0.03)  # ratios 1.2 and 0.6
    (today,) = replicas_for_load(["llama"], 1, timezone.now())
    assert (today.ready, today.replicas) == (2, 3)  # ceil(2 × 1.2 / 0.9)
    assert today.basis == "p90 first token 0.6 s against 0.5 s on 2 replicas serving through the window"
    (doubled,) = replicas_for_load(["llama"], 2, timezone.now())
    assert doubled.replicas == 6
    assert doubled.line().startswith("llama: 6 replicas at 2× the load of the routers' last window (2 ready now)")


def test_without_objectives_in_flight_over_target_concurrency_and_never_below_min():
    model = fleet(ready=1, target_concurrency=8)
    ModelLoad.objects.create(model=model, in_flight=20)
    assert replicas_for_load(["llama"], 3, timezone.now())[0].replicas == 8  # ceil(60 / 8)
    assert replicas_for_load(["llama"], 0.01, timezone.now())[0].replicas == 1  # its min


def test_a_need_above_max_replicas_is_said():
    model = fleet(ready=1, max_replicas=2, target_concurrency=1)
    ModelLoad.objects.create(model=model, in_flight=5)
    (answer,) = replicas_for_load(["llama"], 1, timezone.now())
    assert answer.replicas == 5 and "but its max replicas is 2" in answer.line()


def test_nothing_measured_says_so_instead_of_guessing():
    fleet("quiet", ttft_objective_seconds=0.5)
    fleet("idle", ready=1)
    quiet, idle = replicas_for_load(["quiet", "idle"], 2, timezone.now())
    assert quiet.replicas is None and quiet.line() == "quiet: too few streams in the routers' last window to read a p90"
    assert idle.replicas is None and idle.line() == "idle: no requests in flight in the routers' last reports"


def test_a_constant_number_of_queries(django_assert_num_queries):
    for index in range(4):
        ModelLoad.objects.create(model=fleet(f"m{index}", ttft_objective_seconds=1.0), ttft_p90=2.0)
    with django_assert_num_queries(3):
        replicas_for_load([f"m{index}" for index in range(4)], 1, timezone.now())
