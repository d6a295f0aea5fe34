"""Eviction under pressure in the tick: who is stopped for a waiting replica, and who never is."""

import re
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from hub import get_hub
from reconciler.choices import Hold, ReplicaState
from reconciler.endpoints import build_endpoint_table
from reconciler.lifecycle.transitions import unpublish_grace_seconds
from reconciler.models import Replica, Shard, UsageWatch
from reconciler.outbox import Outbox
from reconciler.placement.eviction import MAKING_ROOM
from reconciler.placement.placer import place_pending
from tests.fleet import make_model, make_node, make_replica

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("usage_known")]


def serving(name, node, *, idle=600, ready=3600, priority=0, min_replicas=0, indices=range(8)):
    """A READY replica of a new 8-GPU model on `node`, idle for `idle` s (None: unknown), ready for `ready` s."""
    # No idle timeout: these tests are about eviction, not the idle stop.
    model = make_model(name, gpus_per_node=8, min_replicas=min_replicas, priority=priority, idle_timeout_seconds=0)
    now = timezone.now()
    replica = make_replica(
        model.profiles.get(),
        placement=[(node, list(indices))],
        last_used=None if idle is None else now - timedelta(seconds=idle),
    )
    Replica.objects.filter(pk=replica.pk).update(ready_at=now - timedelta(seconds=ready))
    return replica


@pytest.fixture
def full_fleet():
    """Two 8×H100 nodes on one fabric, each running one idle 8-GPU model; gpu-b's used longest ago."""
    a, b = make_node("gpu-a", fabric="ib-a"), make_node("gpu-b", fabric="ib-a")
    return a, b, serving("recent", a, idle=300), serving("stale", b, idle=3000)


def ask_for(name, **profile):
    model = make_model(name, gpus_per_node=8, min_replicas=0, **profile)
    async_to_sync(get_hub().request_activation)(name)
    return model


def state_of(replica):
    return Replica.objects.get(pk=replica.pk).state


def test_the_least_recently_used_equal_priority_replica_is_evicted_and_the_newcomer_placed(
    full_fleet, run_tick, agent_inbox, shard_report
):
    _a, b, recent, stale = full_fleet
    inbox = agent_inbox("gpu-b")
    ask_for("newcomer")

    run_tick()

    waiting = Replica.objects.get(model__name="newcomer")
    assert (state_of(stale), state_of(recent)) == (ReplicaState.STOPPING, ReplicaState.READY)
    assert Replica.objects.get(pk=stale.pk).stop_reason.startswith("evicted for newcomer")
    assert waiting.state == ReplicaState.PENDING and waiting.placement_note.startswith(MAKING_ROOM)
    assert waiting.hold == Hold.MAKING_ROOM
    # Routers keep holding its requests: the table does not call it unplaceable.
    assert build_endpoint_table().models["newcomer"].unplaceable is None

    later = timezone.now() + timedelta(seconds=unpublish_grace_seconds() + 1)
    run_tick(now=later)
    drained = Shard.objects.get(replica=stale)
    assert [(c["type"], c["shard_id"]) for c in inbox()] == [("drain_shard", drained.pk)]
    assert Replica.objects.filter(state=ReplicaState.STOPPING).count() == 1  # nothing more stopped meanwhile

    shard_report(b, drained, "stopped")
    run_tick(now=later)
    placed = Replica.objects.get(model__name="newcomer")
    assert placed.state == ReplicaState.STARTING
    assert (placed.hold, placed.placement_note) == (Hold.NONE, "")
    assert Shard.objects.get(replica=placed).node == b


@pytest.mark.parametrize(
    "guarded",
    [
        {"priority": 10},  # higher priority than the waiting model
        {"idle": None},  # last use unknown
        {"idle": 30},  # used too recently
        {"ready": 60},  # too young: ready less than the minimum residency
        {"min_replicas": 1},  # its model would go below min replicas
    ],
)
def test_guarded_replicas_are_never_evicted_the_other_one_is(guarded, run_tick):
    a, b = make_node("gpu-a", fabric="ib-a"), make_node("gpu-b", fabric="ib-a")
    # The guarded one is the least recently used, so only a guard keeps it.
    kept = serving("guarded", a, **{"idle": 5000, **guarded})
    other = serving("other", b, idle=300)
    ask_for("newcomer")

    run_tick()

    assert state_of(kept) == ReplicaState.READY
    assert state_of(other) == ReplicaState.STOPPING


def test_a_replica_with_running_requests_is_never_chosen_even_if_least_recently_used(run_tick):
    a, b = make_node("gpu-a", fabric="ib-a"), make_node("gpu-b", fabric="ib-a")
    streaming = serving("streaming", a, idle=5000)
    Shard.objects.filter(replica=streaming).update(running=1)  # the engine reports a request in flight
    other = serving("other", b, idle=300)
    ask_for("newcomer")

    run_tick()

    assert (state_of(streaming), state_of(other)) == (ReplicaState.READY, ReplicaState.STOPPING)


def test_with_nothing_evictable_the_reason_covers_the_fleet_and_nothing_is_stopped(run_tick):
    a = make_node("gpu-a", fabric="ib-a")
    kept = serving("kept", a, idle=3000, min_replicas=1)  # never evictable: its model's min
    ask_for("newcomer")

    run_tick()

    assert state_of(kept) == ReplicaState.READY
    reason = Replica.objects.get(model__name="newcomer").placement_note
    assert reason == "needs 8×H100-80GB on one node; most free on one node: 0"
    assert build_endpoint_table().models["newcomer"].unplaceable == reason


@pytest.mark.parametrize(
    ("why", "occupant", "wait"),
    [
        # The minimum idle (60 s) and residency (300 s) less what has passed (the test's own second or so).
        ("used 10 s ago", {"idle": 10}, r"in about (48|49|50)s"),
        ("ready 20 s ago", {"idle": 3000, "ready": 20}, r"in about 4m(38|39|40)s"),
        # In use is a reason only until the newcomer has waited the one bound (60 s): then they may be evicted.
        ("running requests", {"idle": 3000}, r"once their requests finish, at the latest in about (5\ds|1m00s)"),
    ],
)
def test_a_replica_evictable_soon_holds_the_newcomers_requests_instead_of_refusing_them(run_tick, why, occupant, wait):
    a = make_node("gpu-a", fabric="ib-a")
    soon = serving("soon", a, **occupant)
    if why == "running requests":
        Shard.objects.filter(replica=soon).update(running=3)
    ask_for("newcomer")

    run_tick()

    assert state_of(soon) == ReplicaState.READY  # nothing is stopped before the rules allow it
    waiting = Replica.objects.get(model__name="newcomer")
    assert waiting.hold == Hold.MAKING_ROOM, why
    assert waiting.placement_note.startswith(f"{MAKING_ROOM}waiting for replica {soon.pk} of soon")
    assert re.search(f"to be evictable {wait}$", waiting.placement_note), waiting.placement_note
    assert build_endpoint_table().models["newcomer"].unplaceable is None  # routers hold its requests


def test_no_eviction_when_the_tick_may_not_act_on_idleness_but_the_newcomer_is_held_not_refused(full_fleet):
    _a, _b, recent, stale = full_fleet
    model = ask_for("newcomer")
    waiting = Replica.objects.create(model=model, profile=model.profiles.get())

    place_pending(timezone.now(), 1, Outbox(1), eviction_paused="idleness is unknown (no router is reporting usage)")

    assert (state_of(recent), state_of(stale)) == (ReplicaState.READY, ReplicaState.READY)
    waiting.refresh_from_db()
    assert waiting.hold == Hold.MAKING_ROOM
    assert re.fullmatch(
        re.escape(f"{MAKING_ROOM}nothing is evicted while idleness is unknown (no router is reporting usage); ")
        + rf"then replica {stale.pk} of stale \(8 GPUs, idle 50m0\ds\) may make room",
        waiting.placement_note,
    ), waiting.placement_note
    assert build_endpoint_table().models["newcomer"].unplaceable is None  # routers hold its requests


def test_while_eviction_is_paused_an_occupant_of_unknown_idleness_holds_the_newcomer_then_it_is_refused():
    """Its stamps may not be collected yet; once idleness is known and it still is not, it is never a candidate."""
    a = make_node("gpu-a", fabric="ib-a")
    occupant = serving("unstamped", a, idle=None)
    model = ask_for("newcomer")
    waiting = Replica.objects.create(model=model, profile=model.profiles.get())

    place_pending(timezone.now(), 1, Outbox(1), eviction_paused="idleness is unknown (no router is reporting usage)")
    waiting.refresh_from_db()
    assert (waiting.hold, state_of(occupant)) == (Hold.MAKING_ROOM, ReplicaState.READY)
    assert waiting.placement_note.endswith(f"then replica {occupant.pk} of unstamped (8 GPUs, idle -) may make room")

    place_pending(timezone.now(), 1, Outbox(1))
    waiting.refresh_from_db()
    assert (waiting.hold, state_of(occupant)) == (Hold.NONE, ReplicaState.READY)
    assert build_endpoint_table().models["newcomer"].unplaceable == waiting.placement_note


def test_a_tick_that_does_not_know_idleness_holds_a_newcomer_eviction_would_place(full_fleet, run_tick):
    """Just after a control plane starts, usage is unknown for a mark's lifetime: a request then is held."""
    _a, _b, recent, stale = full_fleet
    UsageWatch.objects.all().delete()
    ask_for("newcomer")

    report = run_tick()

    assert not report.usage_known, "the watch has just begun: routers may still hold stamps"

    assert (state_of(recent), state_of(stale)) == (ReplicaState.READY, ReplicaState.READY)
    waiting = Replica.objects.get(model__name="newcomer")
    assert waiting.hold == Hold.MAKING_ROOM
    assert waiting.placement_note.startswith(f"{MAKING_ROOM}nothing is evicted while idleness is unknown (waiting")
    assert re.search(
        rf"; then replica {stale.pk} of stale \(8 GPUs, idle 50m0\ds\) may make room$", waiting.placement_note
    )
    assert build_endpoint_table().models["newcomer"].unplaceable is None


def test_two_waiting_replicas_do_not_count_the_same_draining_gpus(full_fleet, run_tick):
    _a, _b, recent, stale = full_fleet
    ask_for("first")
    run_tick()
    assert state_of(stale) == ReplicaState.STOPPING
    ask_for("second")

    run_tick()

    # "first" waits for stale's GPUs; "second" needed victims of its own.
    assert state_of(recent) == ReplicaState.STOPPING
    notes = dict(Replica.objects.filter(state=ReplicaState.PENDING).values_list("model__name", "placement_note"))
    assert notes["first"].startswith(MAKING_ROOM + "waiting for GPUs being freed on gpu-b")
    assert notes["second"].startswith(MAKING_ROOM + "stopping replica")


def test_an_activation_nobody_waits_for_any_more_is_withdrawn_and_leaves_nothing(run_tick, settings):
    settings.LLMGW_ACTIVATION_LINGER_SECONDS = 10
    a = make_node("gpu-a", fabric="ib-a")
    serving("busy", a, idle=10)
    ask_for("newcomer")
    run_tick()
    assert Replica.objects.filter(model__name="newcomer", state=ReplicaState.PENDING).exists()

    # Still asked for: the demand is renewed.
    async_to_sync(get_hub().request_activation)("newcomer")
    run_tick(now=timezone.now() + timedelta(seconds=8))
    assert Replica.objects.filter(model__name="newcomer").exists()

    # The waiting requests gave up: no more asks.
    result = run_tick(now=timezone.now() + timedelta(seconds=30))
    assert Replica.objects.filter(model__name="newcomer").count() == 0
    assert result.replicas_withdrawn == 1
    assert build_endpoint_table().models["newcomer"].unplaceable is None
