"""The hibernate tier in the tick: sleep instead of stop, wake on demand, swaps, and one awake shard per GPU."""

import time
from datetime import timedelta

import msgspec
import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from catalog.choices import SleepLevel
from catalog.models import Profile
from conftest import wait_until
from hub import get_hub
from hub.contracts import EndpointTable
from reconciler.choices import ReplicaState, ShardState
from reconciler.endpoints import build_endpoint_table
from reconciler.hibernate.tier import profile_sleep_level, sleep_level
from reconciler.lifecycle.transitions import unpublish_grace_seconds
from reconciler.models import GPUAssignment, Replica, Shard
from reconciler.outbox import Outbox
from reconciler.signals import work_pending
from tests.fleet import make_model, make_node, make_replica

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("usage_known")]

LATER = timedelta(seconds=unpublish_grace_seconds() + 1)


def serving(name, node, *, idle=600, ready=3600, level=SleepLevel.DISCARD, priority=0, min_replicas=0, **profile):
    """A READY replica of a new 8-GPU model on `node` whose engine was started able to sleep at `level`."""
    model = make_model(
        name, gpus_per_node=8, min_replicas=min_replicas, priority=priority, idle_timeout_seconds=0, **profile
    )
    now = timezone.now()
    replica = make_replica(
        model.profiles.get(), placement=[(node, list(range(8)))], last_used=now - timedelta(seconds=idle)
    )
    Replica.objects.filter(pk=replica.pk).update(ready_at=now - timedelta(seconds=ready), sleep_level=level or None)
    return Replica.objects.get(pk=replica.pk)


def asleep(replica):
    """Make `replica` as it is once its engine has reported it asleep."""
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.SLEEPING, endpoint_url="")
    Shard.objects.filter(replica=replica).update(state=ShardState.SLEEPING)
    GPUAssignment.objects.filter(shard__replica=replica).update(awake=False)
    return Replica.objects.get(pk=replica.pk)


def ask_for(name):
    async_to_sync(get_hub().request_activation)(name)


def state_of(replica):
    return Replica.objects.get(pk=replica.pk).state


def head(replica):
    return Shard.objects.get(replica=replica, rank=0)


# -- invariant 2: at most one awake shard per GPU, in the database ---------------------------------------------


def test_the_database_refuses_a_second_awake_shard_on_a_gpu_and_lets_sleepers_stack():
    node = make_node("gpu-a")
    first = serving("first", node)
    asleep(first)
    second = serving("second", node)  # on the same eight GPUs, awake: allowed, the first sleeps
    asleep(second)
    third = serving("third", node)  # two sleepers and one awake shard on each GPU
    assert GPUAssignment.objects.filter(gpu__node=node, awake=True).count() == 8
    assert GPUAssignment.objects.filter(gpu__node=node, awake=False).count() == 16
    # Waking a sleeper while the third is awake there: the database says no, whatever the caller believed.
    with pytest.raises(IntegrityError), transaction.atomic():
        GPUAssignment.objects.filter(shard__replica=first).update(awake=True)
    assert state_of(third) == ReplicaState.READY


# -- putting to sleep -----------------------------------------------------------------------------------------


def test_eviction_puts_a_sleep_capable_victim_to_sleep_and_places_the_newcomer_once_it_is_asleep(
    run_tick, agent_inbox, shard_report
):
    node = make_node("gpu-a")
    victim = serving("victim", node, idle=3000)
    inbox = agent_inbox("gpu-a")
    make_model("newcomer", gpus_per_node=8, min_replicas=0)
    ask_for("newcomer")

    run_tick()
    assert state_of(victim) == ReplicaState.SLEEPING
    assert "victim" not in {row.model for row in build_endpoint_table().endpoints}  # unpublished at once
    assert inbox() == []  # routers first get the table without it

    run_tick(now=timezone.now() + LATER)
    sent = inbox()
    assert [(c["type"], c["shard_id"], c["level"]) for c in sent] == [("sleep_shard", head(victim).pk, 2)]
    assert head(victim).state == ShardState.FALLING_ASLEEP
    # Still awake until the engine says so: the newcomer waits for the GPUs.
    assert state_of(Replica.objects.get(model__name="newcomer")) == ReplicaState.PENDING

    shard_report(node, head(victim), "sleeping")
    assert not GPUAssignment.objects.filter(shard__replica=victim, awake=True).exists()
    run_tick(now=timezone.now() + LATER)
    newcomer = Replica.objects.get(model__name="newcomer")
    assert newcomer.state == ReplicaState.STARTING
    # Stacked: the sleeper keeps its engine, ports and (asleep) assignments on the same GPUs.
    assert state_of(victim) == ReplicaState.SLEEPING
    assert GPUAssignment.objects.filter(gpu__node=node, awake=False).count() == 8
    assert GPUAssignment.objects.filter(gpu__node=node, awake=True, shard__replica=newcomer).count() == 8


def test_a_victim_whose_engine_cannot_sleep_is_stopped_as_before(run_tick):
    node = make_node("gpu-a")
    victim = serving("victim", node, idle=3000, level=SleepLevel.NEVER)
    make_model("newcomer", gpus_per_node=8, min_replicas=0)
    ask_for("newcomer")
    run_tick()
    assert state_of(victim) == ReplicaState.STOPPING


def test_a_replica_idle_past_its_profiles_sleep_after_sleeps_only_above_min_and_never_when_busy(run_tick):
    node = make_node("gpu-a", gpus=8)
    sleepy = serving("sleepy", node, idle=120, sleep_after_seconds=60)
    kept = serving("kept", make_node("gpu-b"), idle=120, sleep_after_seconds=60, min_replicas=1)
    busy = serving("busy", make_node("gpu-c"), idle=120, sleep_after_seconds=60)
    Shard.objects.filter(replica=busy).update(running=2)
    fresh = serving("fresh", make_node("gpu-d"), idle=30, sleep_after_seconds=60)
    run_tick()
    assert state_of(sleepy) == ReplicaState.SLEEPING
    assert Replica.objects.get(pk=sleepy.pk).sleep_level == SleepLevel.DISCARD
    assert [state_of(r) for r in (kept, busy, fresh)] == [ReplicaState.READY] * 3


def test_idleness_unknown_puts_nothing_to_sleep(run_tick):
    node = make_node("gpu-a")
    replica = serving("sleepy", node, idle=120, sleep_after_seconds=60)
    Replica.objects.filter(pk=replica.pk).update(last_used=None)  # unknown is not idle (invariant 3)
    run_tick()
    assert state_of(replica) == ReplicaState.READY


def test_a_sleeper_past_its_idle_timeout_is_stopped_even_at_min(run_tick):
    replica = asleep(serving("sleepy", make_node("gpu-a"), idle=7200, min_replicas=0))
    Profile.objects.filter(model__name="sleepy").update(idle_timeout_seconds=3600)
    run_tick()
    assert state_of(replica) == ReplicaState.STOPPING


# -- waking and swaps -----------------------------------------------------------------------------------------


def test_a_request_for_a_model_that_only_sleeps_wakes_it_instead_of_starting_another(
    run_tick, agent_inbox, shard_report
):
    node = make_node("gpu-a")
    sleeper = asleep(serving("sleepy", node))
    inbox = agent_inbox("gpu-a")
    ask_for("sleepy")
    run_tick()
    assert state_of(sleeper) == ReplicaState.WAKING
    assert Replica.objects.filter(model__name="sleepy").count() == 1  # no cold start
    assert GPUAssignment.objects.filter(shard__replica=sleeper, awake=True).count() == 8
    assert [(c["type"], c["shard_id"]) for c in inbox()] == [("wake_shard", head(sleeper).pk)]

    shard_report(node, head(sleeper), "ready")
    woken = Replica.objects.get(pk=sleeper.pk)
    assert woken.state == ReplicaState.READY and woken.endpoint_url.endswith(f":{head(sleeper).port}")
    assert (timezone.now() - woken.ready_at).total_seconds() < 5  # its residency starts afresh
    assert "sleepy" in {row.model for row in build_endpoint_table().endpoints}


def test_a_swap_puts_the_idle_occupant_to_sleep_then_wakes_the_sleeper(run_tick, agent_inbox, shard_report):
    node = make_node("gpu-a")
    sleeper = asleep(serving("wanted", node))
    occupant = serving("occupant", node, idle=3000)
    inbox = agent_inbox("gpu-a")
    ask_for("wanted")
    run_tick()
    assert (state_of(occupant), state_of(sleeper)) == (ReplicaState.SLEEPING, ReplicaState.SLEEPING)
    assert Replica.objects.get(pk=occupant.pk).stop_reason == ""  # a sleep, not a stop

    run_tick(now=timezone.now() + LATER)
    assert [c["type"] for c in inbox()] == ["sleep_shard"]
    ask_for("wanted")
    run_tick(now=timezone.now() + LATER)
    assert state_of(sleeper) == ReplicaState.SLEEPING  # the occupant is not asleep yet: no second awake shard

    shard_report(node, head(occupant), "sleeping")
    ask_for("wanted")
    run_tick(now=timezone.now() + LATER)
    assert state_of(sleeper) == ReplicaState.WAKING
    # (The sleep, never acknowledged here, is sent again beside it: the outbox resends until an ack.)
    assert [c["type"] for c in inbox() if c["type"] != "sleep_shard"] == ["wake_shard"]


@pytest.mark.parametrize(
    ("why", "occupant_kwargs"),
    [
        ("busy", {"idle": 3000}),
        ("recently used", {"idle": 5}),
        ("not resident long enough", {"idle": 3000, "ready": 10}),
        ("higher priority", {"idle": 3000, "priority": 5}),
        ("at its min", {"idle": 3000, "min_replicas": 1}),
    ],
)
def test_no_swap_evicts_an_occupant_the_eviction_order_protects(run_tick, why, occupant_kwargs):
    node = make_node("gpu-a")
    sleeper = asleep(serving("wanted", node))
    occupant = serving("occupant", node, **occupant_kwargs)
    if why == "busy":
        Shard.objects.filter(replica=occupant).update(running=1)
    ask_for("wanted")
    run_tick()
    assert (state_of(occupant), state_of(sleeper)) == (ReplicaState.READY, ReplicaState.SLEEPING), why


def test_below_min_with_a_sleeper_wakes_it_rather_than_starting_a_new_one(run_tick):
    node = make_node("gpu-a")
    sleeper = asleep(serving("sleepy", node))
    Profile.objects.filter(model__name="sleepy").update(min_replicas=1)
    run_tick()
    assert state_of(sleeper) == ReplicaState.WAKING
    assert Replica.objects.filter(model__name="sleepy").count() == 1


# -- levels and the engine's start ----------------------------------------------------------------------------


def test_placement_starts_engines_able_to_sleep_at_the_level_their_profile_allows(run_tick, agent_inbox):
    make_node("gpu-a", gpus=2)
    inbox = agent_inbox("gpu-a")
    make_model("deep", engine="vllm", sleep_level=SleepLevel.DISCARD)
    make_model("never", engine="llamacpp")
    run_tick()
    starts = {c["model"]: c for c in inbox() if c["type"] == "start_shard"}
    assert (starts["deep"]["sleep_mode"], "sleep_mode" in starts["never"]) == (True, False)
    levels = dict(Replica.objects.values_list("model__name", "sleep_level"))
    assert levels == {"deep": SleepLevel.DISCARD, "never": None}


def test_the_best_level_is_one_only_when_the_weights_size_is_known():
    weights = type("W", (), {"bytes": 10})()
    assert sleep_level("vllm", None, weights) == SleepLevel.OFFLOAD
    assert sleep_level("vllm", None, None) == SleepLevel.DISCARD  # host memory held would be unknown
    assert sleep_level("sglang", None, None) == SleepLevel.NEVER  # it has only level 1
    assert sleep_level("llamacpp", None, weights) == SleepLevel.NEVER
    assert sleep_level("vllm", SleepLevel.NEVER, weights) == SleepLevel.NEVER
    sized = make_model("sized", engine="vllm").profiles.get()
    sized.model.parameters_billions, sized.model.dtype = 8.0, "bfloat16"
    assert profile_sleep_level(sized) == SleepLevel.OFFLOAD


@pytest.mark.parametrize(
    ("engine", "level", "after", "field"),
    [
        ("llamacpp", 1, None, "sleep_level"),
        ("sglang", 2, None, "sleep_level"),
        ("vllm", 0, 60, "sleep_after_seconds"),
        ("llamacpp", None, 60, "sleep_after_seconds"),
    ],
)
def test_a_profile_asking_its_engine_for_a_sleep_it_cannot_do_is_refused_naming_the_field(engine, level, after, field):
    profile = make_model("m", engine=engine).profiles.get()
    profile.sleep_level, profile.sleep_after_seconds = level, after
    with pytest.raises(ValidationError) as caught:
        profile.full_clean()
    assert field in caught.value.message_dict


def test_a_sleep_command_names_a_level_the_agent_knows():
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
        Outbox(1).sleep("gpu-a", 1, 3, 30.0)


def test_a_wake_or_a_sleep_that_never_completes_fails_the_replica_and_frees_its_gpus(run_tick, settings):
    settings.LLMGW_SHARD_START_TIMEOUT_SECONDS = 60
    settings.LLMGW_DRAIN_TIMEOUT_SECONDS = 30
    waking = asleep(serving("waking", make_node("gpu-a")))
    Replica.objects.filter(pk=waking.pk).update(state=ReplicaState.WAKING)
    GPUAssignment.objects.filter(shard__replica=waking).update(awake=True)
    falling = serving("falling", make_node("gpu-b"))
    Shard.objects.filter(replica=falling).update(state=ShardState.FALLING_ASLEEP)
    Replica.objects.filter(pk=falling.pk).update(state=ReplicaState.SLEEPING)
    past = timezone.now() - timedelta(seconds=61)
    Shard.objects.filter(replica=waking).update(state=ShardState.WAKING, updated_at=past)
    Shard.objects.filter(replica=falling).update(updated_at=past)  # within 60 + 30 s: still waited for

    run_tick()
    assert Replica.objects.get(pk=waking.pk).state == ReplicaState.FAILED
    assert Replica.objects.get(pk=waking.pk).last_error == "not awake within 60 s of its wake"
    assert state_of(falling) == ReplicaState.SLEEPING

    Shard.objects.filter(replica=falling).update(updated_at=past - timedelta(seconds=30))
    run_tick()
    assert Replica.objects.get(pk=falling.pk).state == ReplicaState.FAILED
    assert not GPUAssignment.objects.exists()


def test_routers_are_told_the_learned_wake_time_of_a_model_whose_replicas_all_sleep(run_tick, shard_report):
    node = make_node("gpu-a")
    sleeper = asleep(serving("sleepy", node))
    Profile.objects.filter(model__name="sleepy").update(start_seconds=300.0)
    assert build_endpoint_table().models["sleepy"].start_seconds is None  # no wake learned yet
    ask_for("sleepy")
    run_tick()
    Shard.objects.filter(replica=sleeper).update(updated_at=timezone.now() - timedelta(seconds=4))  # sent 4 s ago
    shard_report(node, head(sleeper), "ready")
    assert 4 <= Profile.objects.get(model__name="sleepy").wake_seconds < 10
    assert build_endpoint_table().models["sleepy"].start_seconds == 300.0  # awake again: a start is the ETA
    asleep(sleeper)
    assert 4 <= build_endpoint_table().models["sleepy"].start_seconds < 10


def test_a_woken_replica_is_published_when_its_head_reports_ready_not_at_the_next_tick(run_tick, shard_report):
    node = make_node("gpu-a")
    sleeper = asleep(serving("sleepy", node))
    ask_for("sleepy")
    run_tick()
    assert state_of(sleeper) == ReplicaState.WAKING
    Replica.objects.filter(pk=sleeper.pk).update(endpoint_url="")
    shard_report(node, head(sleeper), "ready")  # no tick after it
    table = msgspec.json.decode(async_to_sync(get_hub().read_endpoints)(), type=EndpointTable)
    assert [row.replica_id for row in table.endpoints] == [str(sleeper.pk)]


# -- swap-aware admission ---------------------------------------------------------------------------------------


def test_of_two_models_wanting_the_same_gpus_the_one_waiting_longest_is_swapped_in(run_tick):
    node = make_node("gpu-a")
    newer, older = asleep(serving("newer", node)), asleep(serving("older", node))
    occupant = serving("occupant", node, idle=3000)
    Replica.objects.filter(pk=older.pk).update(wanted_since=timezone.now() - timedelta(seconds=20))
    Replica.objects.filter(pk=newer.pk).update(wanted_since=timezone.now() - timedelta(seconds=5))
    ask_for("newer")
    ask_for("older")
    run_tick()
    assert Replica.objects.get(pk=occupant.pk).state == ReplicaState.SLEEPING
    shard_report_asleep(occupant)
    ask_for("newer")
    ask_for("older")
    run_tick(now=timezone.now() + LATER)
    assert (state_of(older), state_of(newer)) == (ReplicaState.WAKING, ReplicaState.SLEEPING)


def test_demand_is_stamped_on_the_sleeper_the_first_tick_it_is_wanted_and_cleared_by_its_wake(run_tick):
    node = make_node("gpu-a")
    sleeper = asleep(serving("wanted", node))
    serving("occupant", node, idle=5)  # in use: the sleeper waits
    ask_for("wanted")
    run_tick()
    first = Replica.objects.get(pk=sleeper.pk).wanted_since
    assert first is not None
    ask_for("wanted")
    run_tick()
    assert Replica.objects.get(pk=sleeper.pk).wanted_since == first  # kept while it waits


def test_the_tick_its_occupant_is_asleep_wakes_the_sleeper_without_waiting_for_the_routers_next_ask(
    run_tick, shard_report, settings
):
    settings.LLMGW_ACTIVATION_LINGER_SECONDS = 10
    node = make_node("gpu-a")
    sleeper = asleep(serving("wanted", node))
    occupant = serving("occupant", node, idle=3000)
    ask_for("wanted")
    run_tick()  # stamps the sleeper and puts the occupant to sleep
    run_tick(now=timezone.now() + LATER)  # sends the occupant its sleep
    shard_report(node, head(occupant), "sleeping")
    run_tick(now=timezone.now() + LATER)  # no ask since the first: the stamp is the demand
    assert state_of(sleeper) == ReplicaState.WAKING


@pytest.mark.parametrize("why", ["stamped longer ago than the linger", "its model has an awake replica"])
def test_a_stale_demand_stamp_wakes_nothing_and_is_cleared(run_tick, settings, why):
    settings.LLMGW_ACTIVATION_LINGER_SECONDS = 10
    node = make_node("gpu-a")
    sleeper = asleep(serving("wanted", node))
    Replica.objects.filter(pk=sleeper.pk).update(wanted_since=timezone.now() - timedelta(seconds=3))
    if why == "its model has an awake replica":
        Profile.objects.filter(pk=sleeper.profile_id).update(max_replicas=2)
        make_replica(sleeper.profile, placement=[(make_node("gpu-b"), list(range(8)))])
        now = timezone.now()
    else:
        now = timezone.now() + timedelta(seconds=10)
    run_tick(now=now)
    assert (state_of(sleeper), Replica.objects.get(pk=sleeper.pk).wanted_since) == (ReplicaState.SLEEPING, None), why


@pytest.mark.parametrize(
    ("case", "start_seconds", "free_node", "elsewhere"),
    [
        ("an occupant of higher priority: no swap to wait for", 20.0, True, True),
        ("a swap in 60 s against a 20 s start", 20.0, True, True),
        ("a swap in 60 s against a 90 s start", 90.0, True, False),
        ("start time not learned", None, True, False),
        ("no free GPUs elsewhere", 20.0, False, False),
    ],
)
def test_a_model_whose_swap_waits_longer_than_a_cold_start_is_started_on_free_gpus_elsewhere(
    run_tick, settings, case, start_seconds, free_node, elsewhere
):
    settings.LLMGW_EVICT_MIN_IDLE_SECONDS, settings.LLMGW_MIN_RESIDENCY_SECONDS = 60, 300
    node = make_node("gpu-a")
    sleeper = asleep(serving("wanted", node))
    Profile.objects.filter(pk=sleeper.profile_id).update(start_seconds=start_seconds, wake_seconds=2.0)
    if case.startswith("an occupant of higher priority"):
        occupant = serving("occupant", node, idle=3000, priority=5)
    else:
        occupant = serving("occupant", node, idle=3000, ready=240)  # may be swapped out in 60 s
    if free_node:
        make_node("gpu-b")
    ask_for("wanted")
    run_tick()
    started = Replica.objects.filter(model__name="wanted").exclude(pk=sleeper.pk)
    assert started.exists() is elsewhere, case
    if elsewhere:
        assert started.get().state == ReplicaState.STARTING  # placed in the same tick, on gpu-b
        assert Shard.objects.get(replica=started.get()).node.name == "gpu-b"
        assert state_of(sleeper) == ReplicaState.STOPPING, "started in its place"
    assert (state_of(occupant), state_of(sleeper) in (ReplicaState.SLEEPING, ReplicaState.STOPPING)) == (
        ReplicaState.READY,
        True,
    )


@pytest.mark.parametrize(("waited", "swapped"), [(10, False), (61, True)])
def test_a_model_waiting_past_the_max_swap_wait_swaps_out_an_occupant_still_in_use(run_tick, settings, waited, swapped):
    settings.LLMGW_MAX_SWAP_WAIT_SECONDS = 60
    node = make_node("gpu-a")
    sleeper = asleep(serving("wanted", node))
    occupant = serving("occupant", node, idle=5)  # used 5 s ago, requests in flight: never idle long enough
    Shard.objects.filter(replica=occupant).update(running=4)
    Replica.objects.filter(pk=sleeper.pk).update(wanted_since=timezone.now() - timedelta(seconds=waited))
    ask_for("wanted")
    run_tick()
    assert (state_of(occupant) == ReplicaState.SLEEPING) is swapped


def test_the_max_swap_wait_never_overrides_the_occupants_residency(run_tick, settings):
    settings.LLMGW_MAX_SWAP_WAIT_SECONDS = 60
    node = make_node("gpu-a")
    sleeper = asleep(serving("wanted", node))
    occupant = serving("occupant", node, idle=5, ready=30)  # woken 30 s ago: resident less than 300 s
    Replica.objects.filter(pk=sleeper.pk).update(wanted_since=timezone.now() - timedelta(seconds=600))
    ask_for("wanted")
    run_tick()
    assert state_of(occupant) == ReplicaState.READY


def shard_report_asleep(replica):
    """What the head's `sleeping` report does (record_asleep), for tests that need no agent."""
    from reconciler.hibernate.tier import record_asleep

    record_asleep(Replica.objects.get(pk=replica.pk))


def test_status_shows_a_sleepers_level_host_memory_and_wake_time():
    from dashboard.summary import cluster_summary

    sleeper = asleep(serving("sleepy", make_node("gpu-a")))
    Replica.objects.filter(pk=sleeper.pk).update(sleeping_level=1, weights_bytes=16 << 30)
    Profile.objects.filter(model__name="sleepy").update(wake_seconds=1.26)
    (row,) = cluster_summary().replica_list
    assert (row.state, row.sleeping_level, row.host_memory_bytes, row.wake_seconds) == ("sleeping", 1, 16 << 30, 1.3)
    assert cluster_summary().replicas.sleeping == 1


def test_the_planner_says_which_victims_would_sleep_rather_than_stop(usage_known):
    from reconciler.planner.what_if import plan_request

    node = make_node("gpu-a")
    serving("sleepy", node, idle=3000)
    make_model("newcomer", gpus_per_node=8, min_replicas=0)
    (answer,) = plan_request(names=["newcomer"]).models
    assert answer.verdict == "fits_after_stopping"
    assert [(s.model, s.sleeps) for s in answer.stop] == [("sleepy", True)]
    assert "  sleep: replica" in "\n".join(answer.lines())


def test_what_can_i_stop_lists_known_idle_sleepers_after_the_gpu_holders():
    from dashboard.summary import cluster_summary

    node = make_node("gpu-a")
    sleeper = asleep(serving("sleepy", node, idle=7200))
    Replica.objects.filter(pk=sleeper.pk).update(sleeping_level=1, weights_bytes=16 << 30)
    holder = serving("holder", node, idle=3000)
    unknown = asleep(serving("unknown", make_node("gpu-b")))
    Replica.objects.filter(pk=unknown.pk).update(last_used=None)  # unknown is not idle: never offered
    stoppable = cluster_summary().stoppable
    assert [(s.replica, s.gpus) for s in stoppable] == [(holder.pk, 8), (sleeper.pk, 0)]
    assert stoppable[1].frees.startswith("16.0 GiB of host memory, its engine process and port (asleep at level 1")


def test_a_swap_blocked_by_the_occupants_residency_tells_the_ticker_when_it_may_go_ahead(
    run_tick, settings, django_capture_on_commit_callbacks
):
    settings.LLMGW_TICK_SECONDS, settings.LLMGW_MIN_RESIDENCY_SECONDS = 2.0, 300
    node = make_node("gpu-a")
    asleep(serving("wanted", node))
    serving("occupant", node, idle=3000, ready=299.7)  # evictable in 0.3 s, before the next regular tick
    told = []

    def receiver(**_kwargs):
        told.append(time.monotonic())

    work_pending.connect(receiver, weak=False, dispatch_uid="swap-due-test")
    try:
        ask_for("wanted")
        began = time.monotonic()
        with django_capture_on_commit_callbacks(execute=True):
            run_tick()
        wait_until(lambda: [t for t in told if t - began >= 0.25], 3, 0.02)
    finally:
        work_pending.disconnect(dispatch_uid="swap-due-test")
