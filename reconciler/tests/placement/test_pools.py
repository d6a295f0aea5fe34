"""Activations for keys bound to pools: a replica starts on a profile in those pools, never on another, and
only when none of the model's replicas there serves them already; the table lists each model's pools."""

import pytest
from asgiref.sync import async_to_sync
from django.db import connection
from django.test.utils import CaptureQueriesContext

from catalog.models import Adapter, Model, Profile
from hub import RedisHub, get_hub
from hub.contracts import Activation
from inventory.models import Node
from reconciler.adapters import split_activations
from reconciler.choices import ReplicaState
from reconciler.endpoints import build_endpoint_table
from reconciler.models import Replica, Shard
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db

L40S = "L40S-48GB"


def two_pools(max_replicas=2, gold_gpus=2):
    """llama on one H100 in pool `default` first, one L40S in pool `gold` second; a node of each class."""
    make_node("gpu-a", gpus=2)
    make_node("gpu-c", gpus=gold_gpus, gpu_class=L40S)
    model = make_model("llama", min_replicas=0, max_replicas=max_replicas)
    gold = Profile.objects.create(model=model, order=1, gpu_class=L40S, pool="gold", max_replicas=2)
    return model, model.profiles.get(order=0), gold


def ask(name, pools=(), hub=None):
    async_to_sync((hub or get_hub()).request_activation)(name, pools)


def test_an_activation_in_a_pool_starts_a_replica_on_the_profile_of_that_pool_not_on_the_first(run_tick):
    model, _, gold = two_pools()
    ask("llama", ["gold", "silver"])

    assert run_tick().replicas_created == 1

    replica = Replica.objects.get(model=model)
    assert (replica.state, replica.profile_id, replica.pools) == (ReplicaState.STARTING, gold.pk, ["gold", "silver"])
    assert Shard.objects.get(replica=replica).node.name == "gpu-c"


def test_an_activation_in_a_pool_through_the_redis_hub_starts_there(run_tick, redis_url):
    model, _, gold = two_pools()
    hub = RedisHub(redis_url)
    ask("llama", ["gold"], hub)
    run_tick(hub=hub)
    assert Replica.objects.get(model=model).profile_id == gold.pk


def test_a_replica_already_in_the_pool_serves_its_activation_and_one_in_another_pool_does_not(run_tick):
    model, default, gold = two_pools(max_replicas=3)
    make_replica(default, placement=[(make_node("gpu-b", gpus=1), [0])])
    ask("llama", ["gold"])
    assert run_tick().replicas_created == 1  # the ready one is in `default`
    assert Replica.objects.get(model=model, profile=gold).state == ReplicaState.STARTING

    ask("llama", ["gold"])
    ask("llama")  # an unbound key is served by either
    assert run_tick().replicas_created == 0
    assert Replica.objects.filter(model=model).count() == 2


def test_a_replica_bound_to_a_pool_with_no_room_there_stays_pending_though_another_pool_has_room(run_tick):
    model, _, _ = two_pools(gold_gpus=0)
    ask("llama", ["gold"])

    run_tick()

    replica = Replica.objects.get(model=model)
    assert replica.state == ReplicaState.PENDING
    assert replica.placement_note.startswith("in pool gold: ")
    assert "H100" not in replica.placement_note  # the `default` profile, with room, was not tried
    # Asked again while it waits: its demand is renewed, no second replica.
    ask("llama", ["gold"])
    assert run_tick().replicas_created == 0


def test_an_unbound_key_is_not_held_up_by_a_pools_lack_of_room_and_the_table_says_whose_note_it_is(run_tick):
    model, default, gold = two_pools(gold_gpus=0)
    ask("llama", ["gold"])
    run_tick()
    assert build_endpoint_table().models["llama"].unplaceable_pools == ["gold"]

    ask("llama")
    assert run_tick().replicas_created == 1
    states = dict(Replica.objects.filter(model=model).values_list("profile_id", "state"))
    assert states == {gold.pk: ReplicaState.PENDING, default.pk: ReplicaState.STARTING}


def test_an_unbound_replicas_note_speaks_for_the_model_before_a_pool_bound_ones():
    model, default, gold = two_pools()
    # The bound one first in the order notes are read (its profile is the model's first).
    Replica.objects.create(model=model, profile=default, pools=["default"], placement_note="in pool default: none")
    Replica.objects.create(model=model, profile=gold, placement_note="no room anywhere")
    entry = build_endpoint_table().models["llama"]
    assert (entry.unplaceable, entry.unplaceable_pools) == ("no room anywhere", [])


def test_a_pending_replica_that_may_land_in_another_pool_does_not_serve_a_pool_bound_activation(run_tick):
    model, default, gold = two_pools()
    Replica.objects.create(model=model, profile=default)  # unbound: it may go on either profile
    ask("llama", ["gold"])
    assert run_tick().replicas_created == 1
    assert sorted(Replica.objects.filter(model=model).values_list("profile_id", flat=True)) == [default.pk, gold.pk]


def test_an_activation_in_pools_the_model_has_no_profile_in_starts_nothing(run_tick):
    model, _, _ = two_pools()
    ask("llama", ["silver"])
    assert run_tick().replicas_created == 0
    assert not Replica.objects.filter(model=model).exists()


def test_an_adapters_activation_asks_for_its_base_in_the_same_pools():
    model, _, _ = two_pools()
    adapter = Adapter.objects.create(name="tuned", base=model, source="org/tuned")
    asked = {Activation(model="tuned", pools=("gold",)), Activation(model="qwen")}
    assert split_activations(asked) == (
        {Activation(model="llama", pools=("gold",)), Activation(model="qwen")},
        {adapter.pk},
    )


def test_the_endpoint_table_lists_each_models_pools():
    two_pools()
    make_model("qwen")
    models = build_endpoint_table().models
    assert models["llama"].pools == ["default", "gold"]
    assert models["qwen"].pools == ["default"]


def test_a_tick_with_a_pool_bound_activation_runs_the_queries_of_an_unbound_one(run_tick):
    counts = []
    # The first round is a warm-up: a test's first tick also records the usage watch's first verdict.
    for pools in ((), ("gold",), ()):
        two_pools()
        ask("llama", pools)
        with CaptureQueriesContext(connection) as queries:
            run_tick()
        assert Replica.objects.get().state == ReplicaState.STARTING
        counts.append(len(queries))
        Model.objects.all().delete()
        Node.objects.all().delete()
    assert counts[1] == counts[2], counts
