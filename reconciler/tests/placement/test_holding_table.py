"""The endpoint table tells routers why a model's requests are held when it is not a start: a wake (its wanted
replicas only sleep) or room being made for it; a table that says neither keeps its old wire shape."""

from datetime import timedelta

import msgspec
import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from hub import get_hub
from hub.contracts import EndpointTable, ModelEntry
from reconciler.choices import Hold, ReplicaState
from reconciler.endpoints import build_endpoint_table
from reconciler.models import Replica
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


def replicas(name, *states, hold=Hold.NONE, error=""):
    """A new model `name` with a replica in each of `states` (a pending one with its placement note and hold)."""
    profile = make_model(name, max_replicas=max(1, len(states))).profiles.get()
    for state in states:
        replica = make_replica(profile, state=state, error=error)
        Replica.objects.filter(pk=replica.pk).update(hold=hold)


def holding():
    return {name: entry.holding for name, entry in build_endpoint_table().models.items()}


def test_a_model_whose_wanted_replicas_only_sleep_or_wake_is_held_for_a_wake():
    replicas("asleep", ReplicaState.SLEEPING)
    replicas("waking", ReplicaState.SLEEPING, ReplicaState.WAKING)
    # A sleeper beside a replica that serves or starts: its requests go there or wait for a start, not a wake.
    replicas("serving", ReplicaState.SLEEPING, ReplicaState.READY)
    replicas("starting", ReplicaState.SLEEPING, ReplicaState.STARTING)
    replicas("idle")
    assert holding() == {"asleep": "wake", "waking": "wake", "serving": None, "starting": None, "idle": None}


def test_a_model_room_is_made_for_is_held_for_making_room_and_one_waiting_for_nodes_as_a_start():
    replicas("room", ReplicaState.PENDING, hold=Hold.MAKING_ROOM, error="making room: stopping replica 7")
    replicas("nodes", ReplicaState.PENDING, hold=Hold.WAITING_FOR_NODES, error="waiting for nodes to report in: x")
    replicas("stuck", ReplicaState.PENDING, error="no node has GPU class X")
    models = build_endpoint_table().models
    assert {name: (entry.holding, entry.unplaceable) for name, entry in models.items()} == {
        "room": ("making_room", None),
        "nodes": (None, None),
        "stuck": (None, "no node has GPU class X"),
    }


@pytest.mark.usefixtures("usage_known")
def test_the_tick_that_evicts_for_a_model_marks_it_making_room(run_tick):
    for node_name, name in (("gpu-a", "recent"), ("gpu-b", "stale")):
        node = make_node(node_name, fabric="ib-a")
        model = make_model(name, gpus_per_node=8, min_replicas=0, idle_timeout_seconds=0)
        old = make_replica(
            model.profiles.get(),
            placement=[(node, list(range(8)))],
            last_used=timezone.now() - timedelta(seconds=3000),
        )
        Replica.objects.filter(pk=old.pk).update(ready_at=timezone.now() - timedelta(hours=1))
    make_model("newcomer", gpus_per_node=8, min_replicas=0)
    async_to_sync(get_hub().request_activation)("newcomer")

    run_tick()

    assert Replica.objects.get(model__name="newcomer").hold == Hold.MAKING_ROOM
    assert holding() == {"newcomer": "making_room", "recent": None, "stale": None}


def test_the_table_with_every_kind_of_hold_is_still_built_in_five_queries(django_assert_num_queries):
    replicas("asleep", ReplicaState.SLEEPING)
    replicas("room", ReplicaState.PENDING, hold=Hold.MAKING_ROOM, error="making room: stopping replica 7")
    replicas("stuck", ReplicaState.PENDING, error="no node has GPU class X")
    with django_assert_num_queries(5):
        build_endpoint_table()


def test_a_table_that_holds_nothing_keeps_its_wire_shape_and_a_hold_adds_one_field():
    quiet = EndpointTable(models={"m": ModelEntry(aliases=["a"], start_seconds=20.0)})
    assert msgspec.json.encode(quiet) == b'{"models":{"m":{"aliases":["a"],"start_seconds":20.0}}}'
    woken = EndpointTable(models={"m": ModelEntry(aliases=["a"], holding="wake")})
    assert msgspec.json.encode(woken) == b'{"models":{"m":{"aliases":["a"],"holding":"wake"}}}'
    assert msgspec.json.decode(b'{"models":{"m":{"aliases":["a"]}}}', type=EndpointTable) == EndpointTable(
        models={"m": ModelEntry(aliases=["a"])}
    )


def test_a_hold_the_routers_do_not_know_is_refused_by_the_contract():
    with pytest.raises(msgspec.ValidationError, match="holding"):
        msgspec.json.decode(b'{"aliases":[],"holding":"nap"}', type=ModelEntry)
