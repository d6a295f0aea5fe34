"""One bound for a cold start and a swap: a replica whose requests are held, waiting for GPUs held by occupants still
in use, waits at most LLMGW_MAX_SWAP_WAIT_SECONDS (from the first tick it found no room), then they are evicted (a
drain: nothing is cut), under the same residency, priority and min-replicas rules as a swap; unknown idleness is still
never idle, and a model already serving (a scale-out) waits for idle occupants only."""

import re
import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from catalog.models import Model, Profile
from conftest import wait_until
from hub import get_hub
from inventory.models import Node
from reconciler.choices import Hold, ReplicaState
from reconciler.lifecycle.transitions import fail_replicas, unpublish_grace_seconds
from reconciler.models import Replica, Shard
from reconciler.outbox import Outbox
from reconciler.signals import work_pending
from reconciler.tests.placement.test_making_room import ask_for, serving, state_of
from tests.fleet import make_node, make_replica

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("usage_known")]


def busy(name="busy", **fields):
    """An 8-GPU model on the only node, used a second ago and running requests."""
    occupant = serving(name, make_node("gpu-a", fabric="ib-a"), idle=1, **fields)
    Shard.objects.filter(replica=occupant).update(running=2)
    return occupant


def newcomer_waited(seconds: float, **profile) -> Replica:
    """A replica of a new 8-GPU model that first found no room `seconds` ago, its routers still asking."""
    model = ask_for("newcomer", **profile)
    replica = Replica.objects.create(model=model, profile=model.profiles.get())
    Replica.objects.filter(pk=replica.pk).update(wanted_since=timezone.now() - timedelta(seconds=seconds))
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


def test_a_cold_start_held_by_occupants_in_use_tells_the_ticker_when_the_bound_is_reached(run_tick, settings):
    settings.LLMGW_TICK_SECONDS, settings.LLMGW_MAX_SWAP_WAIT_SECONDS = 2.0, 60
    busy()
    newcomer_waited(59.7)  # the bound is reached in 0.3 s, before the next regular tick
    told = []
    work_pending.connect(lambda **_: told.append(time.monotonic()), weak=False, dispatch_uid="one-bound-test")
    try:
        began = time.monotonic()
        run_tick()
        wait_until(lambda: [t for t in told if t - began >= 0.2], 3, 0.02)
    finally:
        work_pending.disconnect(dispatch_uid="one-bound-test")


@pytest.mark.parametrize(
    ("sleep_level", "state", "command"),
    [(None, ReplicaState.STOPPING, "drain_shard"), (2, ReplicaState.SLEEPING, "sleep_shard")],
)
def test_past_the_bound_an_occupant_in_use_is_drained_for_the_cold_start(
    run_tick, settings, agent_inbox, sleep_level, state, command
):
    """Stopped or put to sleep, either way a drain: its engine finishes what it runs; nothing is cut."""
    settings.LLMGW_MAX_SWAP_WAIT_SECONDS = 60
    occupant = busy()
    Replica.objects.filter(pk=occupant.pk).update(sleep_level=sleep_level)
    inbox = agent_inbox("gpu-a")
    waiting = newcomer_waited(61)
    run_tick()
    assert state_of(occupant) == state
    waiting.refresh_from_db()
    assert waiting.hold == Hold.MAKING_ROOM and f"stopping replica {occupant.pk} of busy" in waiting.placement_note
    assert inbox() == []  # unpublished first: the routers send it nothing new

    async_to_sync(get_hub().request_activation)("newcomer")
    run_tick(now=timezone.now() + timedelta(seconds=unpublish_grace_seconds() + 1))
    assert [c["type"] for c in inbox()] == [command]


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


def test_the_wait_counts_from_the_first_tick_without_room_not_from_the_replicas_creation(
    run_tick, settings, shard_report
):
    """A replica pending again (its node lost, its engine failed) may be hours old: its new wait starts afresh."""
    settings.LLMGW_MAX_SWAP_WAIT_SECONDS = 10  # (ticks an hour apart would find the node silent)
    occupant = busy()
    waiting = newcomer_waited(0)
    Replica.objects.filter(pk=waiting.pk).update(created_at=timezone.now() - timedelta(hours=2), wanted_since=None)
    first = timezone.now()
    run_tick(now=first)
    waiting.refresh_from_db()
    assert state_of(occupant) == ReplicaState.READY
    assert waiting.wanted_since == first and re.search(r"at the latest in about 10s$", waiting.placement_note)

    async_to_sync(get_hub().request_activation)("newcomer")  # its routers still hold requests
    run_tick(now=first + timedelta(seconds=11))
    assert state_of(occupant) == ReplicaState.STOPPING

    shard_report(Shard.objects.get(replica=occupant).node, Shard.objects.get(replica=occupant), "stopped")
    run_tick(now=first + timedelta(seconds=12))
    waiting.refresh_from_db()
    assert (waiting.state, waiting.wanted_since) == (ReplicaState.STARTING, None)  # placed: its wait is over


def test_a_replica_taken_out_of_service_waits_afresh(settings):
    settings.LLMGW_MAX_SWAP_WAIT_SECONDS = 60
    replica = busy()
    Replica.objects.filter(pk=replica.pk).update(wanted_since=timezone.now() - timedelta(hours=1))
    fail_replicas([replica.pk], "node lost", timezone.now(), Outbox(1), node_fault=True)
    replica.refresh_from_db()
    assert (replica.state, replica.wanted_since) == (ReplicaState.PENDING, None)


def test_a_replica_of_a_model_already_serving_waits_for_idle_occupants_only(run_tick, settings):
    """A scale-out's requests are served meanwhile: the bound is for held ones, so busy models never drain
    each other."""
    settings.LLMGW_MAX_SWAP_WAIT_SECONDS = 60
    occupant = busy()
    waiting = newcomer_waited(600, max_replicas=2)
    make_replica(waiting.profile, placement=[(make_node("gpu-b", fabric="ib-a"), range(8))], last_used=timezone.now())
    run_tick()
    waiting.refresh_from_db()
    assert state_of(occupant) == ReplicaState.READY
    assert waiting.hold == Hold.MAKING_ROOM and waiting.placement_note.endswith("once their requests finish")


def test_a_ready_replica_in_another_pool_does_not_serve_held_requests_bound_to_one(run_tick, settings):
    settings.LLMGW_MAX_SWAP_WAIT_SECONDS = 60
    occupant = busy()
    waiting = newcomer_waited(61, max_replicas=2)
    Replica.objects.filter(pk=waiting.pk).update(pools=["default"])
    Profile.objects.filter(pk=waiting.profile.pk).update(pool="default")
    elsewhere = Profile.objects.create(model=waiting.model, order=1, gpus_per_node=8, pool="silver", max_replicas=1)
    make_replica(elsewhere, placement=[(make_node("gpu-b", fabric="ib-a"), range(8))], last_used=timezone.now())
    run_tick()
    assert state_of(occupant) == ReplicaState.STOPPING


def test_draining_an_occupant_in_use_for_a_cold_start_costs_the_same_queries_whatever_the_fleet(
    run_tick, settings, django_assert_max_num_queries
):
    """The tick as a whole (47 queries on PostgreSQL, 45 on SQLite, one of them the stages of the pending
    replicas' weights): the bound reads nothing of its own, and the wait's stamp is written with the note."""
    settings.LLMGW_MAX_SWAP_WAIT_SECONDS = 60
    counts = {}
    for size in (2, 12):
        Replica.objects.all().delete()
        Model.objects.all().delete()
        Node.objects.all().delete()
        for i in range(size):
            occupant = serving(f"busy-{i:02d}", make_node(f"gpu-{i:02d}", fabric="ib-a"), idle=1)
            Shard.objects.filter(replica=occupant).update(running=2)
        newcomer_waited(61)
        with CaptureQueriesContext(connection) as queries, django_assert_max_num_queries(47):
            run_tick()
        assert Replica.objects.filter(state=ReplicaState.STOPPING).count() == 1
        counts[size] = len(queries)
    assert counts[2] == counts[12], counts
