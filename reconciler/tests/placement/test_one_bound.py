"""One bound for a cold start and a swap: a replica waiting for GPUs held by occupants still in use waits at most
LLMGW_MAX_SWAP_WAIT_SECONDS, then they are evicted (a drain: nothing is cut), under the same residency, priority and
min-replicas rules as a swap; unknown idleness is still never idle."""

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from reconciler.choices import Hold, ReplicaState
from reconciler.models import Replica, Shard
from reconciler.tests.placement.test_making_room import ask_for, serving, state_of
from tests.fleet import make_node

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("usage_known")]


def busy(name="busy", **fields):
    """An 8-GPU model on the only node, used a second ago and running requests."""
    occupant = serving(name, make_node("gpu-a", fabric="ib-a"), idle=1, **fields)
    Shard.objects.filter(replica=occupant).update(running=2)
    return occupant


def newcomer_waited(seconds: float, **profile) -> Replica:
    """A replica of a new 8-GPU model whose demand began `seconds` ago, its routers still asking."""
    model = ask_for("newcomer", **profile)
    replica = Replica.objects.create(model=model, profile=model.profiles.get())
    Replica.objects.filter(pk=replica.pk).update(created_at=timezone.now() - timedelta(seconds=seconds))
    return replica


def test_before_the_bound_a_cold_start_holds_and_evicts_nothing_in_use(run_tick, settings):
    settings.LLMGW_MAX_SWAP_WAIT_SECONDS = 60
    occupant = busy()
    waiting = newcomer_waited(30)
    run_tick()
    assert state_of(occupant) == ReplicaState.READY
    waiting.refresh_from_db()
    assert waiting.hold == Hold.MAKING_ROOM
    assert re.search(r"once their requests finish, at the latest in about (29|30)s$", waiting.placement_note)


def test_past_the_bound_an_occupant_in_use_is_drained_for_the_cold_start(run_tick, settings):
    settings.LLMGW_MAX_SWAP_WAIT_SECONDS = 60
    occupant = busy()
    waiting = newcomer_waited(61)
    run_tick()
    assert state_of(occupant) == ReplicaState.STOPPING  # a drain: its engine finishes what it runs
    waiting.refresh_from_db()
    assert waiting.hold == Hold.MAKING_ROOM and f"stopping replica {occupant.pk} of busy" in waiting.placement_note


@pytest.mark.parametrize(
    ("why", "fields"),
    [
        ("a higher priority", {"priority": 5}),
        ("ready too briefly", {"ready": 10}),
        ("at its model's min", {"min_replicas": 1}),
    ],
)
def test_past_the_bound_the_other_rules_still_protect_an_occupant(run_tick, settings, why, fields):
    settings.LLMGW_MAX_SWAP_WAIT_SECONDS = 60
    occupant = busy(**fields)
    newcomer_waited(600)
    run_tick()
    assert state_of(occupant) == ReplicaState.READY, why


def test_past_the_bound_an_occupant_of_unknown_idleness_is_never_evicted(run_tick, settings):
    settings.LLMGW_MAX_SWAP_WAIT_SECONDS = 60
    occupant = serving("unknown", make_node("gpu-a", fabric="ib-a"), idle=None)
    newcomer_waited(600)
    run_tick()
    assert state_of(occupant) == ReplicaState.READY
