"""The reconcile tick and the shard lifecycle, end to end on the database and the in-memory channel layer."""

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from catalog.models import Alias, Model, Profile
from hub import get_hub
from inventory.choices import GPUHealth, NodeState
from inventory.models import GPU, Node
from reconciler.agent_reports import reconcile_reported_shards, record_shard_status
from reconciler.choices import ReplicaState, ShardState
from reconciler.endpoints import build_endpoint_table
from reconciler.lease import Leadership, try_acquire
from reconciler.lifecycle import backoff_seconds, stop_replica
from reconciler.models import GPUAssignment, Replica, Shard
from reconciler.outbox import current_epoch
from reconciler.signals import work_pending
from reconciler.tick import tick
from tests.fleet import H100, make_model, make_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def leader():
    """This test's leader, holding the lease since long enough to declare nodes lost."""
    leadership = Leadership(ttl=60)
    assert leadership.renew()
    leadership.leader_since = timezone.now() - timedelta(days=1)
    return leadership


@pytest.fixture
def run_tick(leader, django_capture_on_commit_callbacks):
    """Tick as the leader and run what it sends after commit (the test transaction never commits)."""

    def run(now=None):
        with django_capture_on_commit_callbacks(execute=True):
            return tick(leadership=leader, hub=get_hub(), now=now)

    return run


@pytest.fixture
def agent_inbox():
    """Join a node's group on the real in-memory channel layer; return a function draining its commands."""
    layer = get_channel_layer()

    def join(node_name):
        channel = async_to_sync(layer.new_channel)()
        async_to_sync(layer.group_add)(f"node.{node_name}", channel)

        async def drain():
            commands = []
            while True:
                try:
                    message = await asyncio.wait_for(layer.receive(channel), 0.05)
                except TimeoutError:
                    return commands
                commands.append(message["command"])

        return async_to_sync(drain)

    return join


def report(node, shard, state, message="", port=None, capture=None):
    with capture(execute=True):
        record_shard_status(node, shard.pk, state, message, port)


# --- placement and dispatch ----------------------------------------------------


def test_min_replica_is_placed_best_fit_with_shard_assignments_and_a_start_command(run_tick, leader, agent_inbox):
    roomy, snug = make_node("gpu-a", gpus=8), make_node("gpu-b", gpus=2)
    inbox = {"gpu-a": agent_inbox("gpu-a"), "gpu-b": agent_inbox("gpu-b")}
    model = make_model("llama", gpus_per_node=2, engine_args=["--max-model-len", "8192"])

    result = run_tick()

    replica = Replica.objects.get(model=model)
    assert (result.leader, result.replicas_created, result.replicas_placed) == (True, 1, 1)
    assert replica.state == ReplicaState.STARTING
    assert replica.epoch == leader.epoch == 1
    assert replica.started_at is not None and replica.placement_error == ""
    shard = replica.shards.get()
    assert (shard.node, shard.rank, shard.port, shard.state) == (snug, 0, 20000, ShardState.ASSIGNED)
    assert sorted(shard.gpu_assignments.values_list("gpu__index", flat=True)) == [0, 1]
    assert inbox["gpu-a"]() == []
    assert inbox["gpu-b"]() == [
        {
            "type": "start_shard",
            "v": 1,
            "epoch": 1,
            "shard_id": shard.pk,
            "replica_id": replica.pk,
            "rank": 0,
            "node_count": 1,
            "head_address": "127.0.0.1",
            "engine": "vllm",
            "model": "llama",
            "source": "org/llama",
            "gpu_indices": [0, 1],
            "port": 20000,
            "args": ["--max-model-len", "8192"],
            "env": {},
        }
    ]
    assert roomy.shards.count() == 0


def test_multi_node_replica_gets_whole_nodes_on_one_fabric_and_the_head_address(run_tick, agent_inbox):
    make_node("gpu-a", gpus=4, fabric="ib-a", address="10.0.0.1")
    make_node("gpu-b", gpus=4, fabric="ib-a", address="10.0.0.2")
    make_node("gpu-c", gpus=4, fabric="ib-b", address="10.0.0.3")
    inbox = agent_inbox("gpu-b")
    make_model("big", gpus_per_node=4, nodes_per_replica=2)

    run_tick()

    shards = list(Shard.objects.order_by("rank").values_list("node__name", "rank"))
    assert shards == [("gpu-a", 0), ("gpu-b", 1)]
    (start,) = inbox()
    assert (start["rank"], start["node_count"], start["head_address"]) == (1, 2, "10.0.0.1")


def test_unplaceable_replica_keeps_an_aggregate_explanation(run_tick):
    make_node("gpu-a", gpus=2)
    model = make_model("huge", gpus_per_node=4)

    result = run_tick()

    replica = Replica.objects.get(model=model)
    assert replica.state == ReplicaState.PENDING
    assert replica.placement_error == "needs 4×H100-80GB on one node; most free on one node: 2 (gpu-a)"
    assert result.replicas_unplaceable == 1


def test_unhealthy_and_quarantined_gpus_are_not_free(run_tick, settings):
    settings.LLMGW_GPU_QUARANTINE_SECONDS = 300
    node = make_node("gpu-a", gpus=4)
    GPU.objects.filter(node=node, index=0).update(health=GPUHealth.UNHEALTHY)
    GPU.objects.filter(node=node, index=1).update(healthy_since=timezone.now() - timedelta(seconds=10))
    GPU.objects.filter(node=node, index=2).update(healthy_since=timezone.now() - timedelta(seconds=600))
    model = make_model("llama", gpus_per_node=3)

    run_tick()
    assert Replica.objects.get(model=model).placement_error.endswith("most free on one node: 2 (gpu-a)")

    Profile.objects.filter(model=model).update(gpus_per_node=2)
    run_tick()
    assert sorted(GPUAssignment.objects.values_list("gpu__index", flat=True)) == [2, 3]


def test_status_counts_free_exactly_the_gpus_the_placer_will_use(run_tick, settings):
    """DESIGN invariants 5 and 6: the summary's "free" and the placer share one rule."""
    from dashboard.summary import cluster_summary

    settings.LLMGW_GPU_QUARANTINE_SECONDS = 300
    now = timezone.now()
    node = make_node("gpu-a", gpus=6)
    GPU.objects.filter(node=node, index=0).update(health=GPUHealth.UNHEALTHY)
    GPU.objects.filter(node=node, index=1).update(healthy_since=now - timedelta(seconds=60))  # in quarantine
    GPU.objects.filter(node=node, index=2).update(healthy_since=now - timedelta(seconds=600))  # served it
    cordoned = make_node("gpu-b", gpus=2)
    Node.objects.filter(pk=cordoned.pk).update(schedulable=False)
    free = next(c for c in cluster_summary()["capacity"] if c["gpu_class"] == H100)["free"]
    assert free == 4
    make_model("llama", min_replicas=free + 2, max_replicas=free + 2)

    report = run_tick()

    assert report.replicas_placed == free and report.replicas_unplaceable == 2
    assert next(c for c in cluster_summary()["capacity"] if c["gpu_class"] == H100)["free"] == 0


def test_cordoned_and_unready_nodes_get_no_shards(run_tick):
    make_node("gpu-a").__class__.objects.filter(name="gpu-a").update(schedulable=False)
    Node.objects.filter(pk=make_node("gpu-b").pk).update(state=NodeState.NEW)
    make_model("llama")

    run_tick()

    assert Shard.objects.count() == 0
    assert Replica.objects.get().placement_error == "no node has GPU class H100-80GB"


def test_ports_come_from_the_range_and_are_not_reused_on_a_node(run_tick):
    make_node("gpu-a", gpus=8)
    make_model("one")
    make_model("two")

    run_tick()

    assert sorted(Shard.objects.values_list("port", flat=True)) == [20000, 20001]


def test_nodes_sharing_an_address_share_one_port_space(run_tick):
    """Simulated nodes on one box must not be handed the same engine port."""
    make_node("gpu-a", gpus=1, address="127.0.0.1")
    make_node("gpu-b", gpus=1, address="127.0.0.1")
    make_model("one")
    make_model("two")

    run_tick()

    shards = Shard.objects.order_by("port")
    assert {s.node.name for s in shards} == {"gpu-a", "gpu-b"}
    assert [s.port for s in shards] == [20000, 20001]


def test_a_gpu_held_twice_is_refused_by_the_database_constraint():
    """DESIGN invariant 2: the constraint, not the placer, stops double-booking."""
    node = make_node("gpu-a", gpus=1)
    model = make_model("llama")
    gpu = node.gpus.get()
    shards = []
    for port in (20000, 20001):
        replica = Replica.objects.create(model=model, profile=model.profiles.get(), state=ReplicaState.STARTING)
        shards.append(Shard.objects.create(replica=replica, node=node, port=port))
    GPUAssignment.objects.create(gpu=gpu, shard=shards[0])
    with pytest.raises(IntegrityError), transaction.atomic():
        GPUAssignment.objects.create(gpu=gpu, shard=shards[1])


# --- readiness and publishing ---------------------------------------------------


def test_ready_report_makes_the_replica_ready_and_the_next_tick_publishes_it(
    run_tick, django_capture_on_commit_callbacks
):
    node = make_node("gpu-a")
    model = make_model("llama", priority=5, weight=3, pool="gold")
    Alias.objects.create(model=model, name="llama-latest")
    run_tick()
    replica = Replica.objects.get()
    shard = replica.shards.get()
    hub = get_hub()
    woken = []
    work_pending.connect(lambda **_: woken.append(True), weak=False, dispatch_uid="test-woken")

    report(node, shard, "starting", capture=django_capture_on_commit_callbacks)
    assert Shard.objects.get().state == ShardState.STARTING
    Replica.objects.filter(pk=replica.pk).update(started_at=timezone.now() - timedelta(seconds=42))
    report(node, shard, "ready", port=20000, capture=django_capture_on_commit_callbacks)

    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY
    assert replica.endpoint_url == "http://127.0.0.1:20000"
    assert replica.ready_at is not None
    work_pending.disconnect(dispatch_uid="test-woken")
    assert woken, "a replica turning ready must wake the ticker"
    assert run_tick().published is True
    table = async_to_sync(hub.read_endpoints)()
    assert table["models"] == {"llama": {"aliases": ["llama-latest"], "start_seconds": 42.0}}
    assert table["endpoints"] == [
        {
            "replica_id": str(replica.pk),
            "model": "llama",
            "url": "http://127.0.0.1:20000",
            "priority": 5,
            "weight": 3,
            "pool": "gold",
        }
    ]


def test_an_unchanged_endpoint_table_is_published_once(run_tick):
    """DESIGN invariant 7."""
    make_node("gpu-a")
    make_model("llama", min_replicas=0)
    assert run_tick().published is True
    first = async_to_sync(get_hub().read_endpoints)()
    assert run_tick().published is False
    assert async_to_sync(get_hub().read_endpoints)() is first


def test_endpoint_table_lists_enabled_models_with_profiles_in_five_queries(django_assert_max_num_queries):
    make_model("llama", min_replicas=0)
    make_model("off", min_replicas=0, enabled=False)
    Model.objects.create(name="bare", source="org/bare")
    with django_assert_max_num_queries(5):
        table = build_endpoint_table()
    assert table == {"models": {"llama": {"aliases": []}}, "endpoints": []}


def test_endpoint_table_says_why_a_wanted_model_cannot_be_placed(run_tick):
    make_model("llama", min_replicas=1)  # no node has its GPU class

    run_tick()

    assert build_endpoint_table()["models"]["llama"] == {
        "aliases": [],
        "unplaceable": "no node has GPU class H100-80GB",
    }


def test_start_times_are_learned_per_profile_as_a_moving_average(run_tick, django_capture_on_commit_callbacks):
    node = make_node("gpu-a")
    model = make_model("llama", min_replicas=2, max_replicas=2)
    run_tick()
    first, second = Replica.objects.order_by("id")
    for replica, took in ((first, 30), (second, 10)):
        Replica.objects.filter(pk=replica.pk).update(started_at=timezone.now() - timedelta(seconds=took))
        report(node, replica.shards.get(), "ready", capture=django_capture_on_commit_callbacks)

    assert model.profiles.get().start_seconds == pytest.approx(20.0, abs=0.5)  # (30 + 10) / 2


def test_multi_node_replica_is_ready_only_when_every_shard_is(run_tick, django_capture_on_commit_callbacks):
    make_node("gpu-a", gpus=2, fabric="ib-a", address="10.0.0.1")
    make_node("gpu-b", gpus=2, fabric="ib-a", address="10.0.0.2")
    make_model("big", gpus_per_node=2, nodes_per_replica=2)
    run_tick()
    head, worker = Shard.objects.select_related("node").order_by("rank")

    report(worker.node, worker, "ready", capture=django_capture_on_commit_callbacks)
    assert Replica.objects.get().state == ReplicaState.STARTING
    report(head.node, head, "ready", capture=django_capture_on_commit_callbacks)
    assert Replica.objects.get().endpoint_url == f"http://10.0.0.1:{head.port}"


def test_a_node_cannot_report_on_another_nodes_shard(run_tick, django_capture_on_commit_callbacks):
    make_node("gpu-a")
    other = make_node("gpu-b", gpus=0)
    make_model("llama")
    run_tick()
    shard = Shard.objects.get()

    report(other, shard, "ready", capture=django_capture_on_commit_callbacks)

    assert Shard.objects.get().state == ShardState.ASSIGNED
    assert Replica.objects.get().state == ReplicaState.STARTING


def test_a_report_with_a_bad_state_is_refused():
    node = make_node("gpu-a", gpus=0)
    with pytest.raises(ValueError, match="not one of"):
        record_shard_status(node, 1, "running")


# --- failure and backoff --------------------------------------------------------


def test_backoff_doubles_from_the_base_up_to_the_cap(settings):
    settings.LLMGW_BACKOFF_BASE_SECONDS, settings.LLMGW_BACKOFF_MAX_SECONDS = 5, 300
    assert [backoff_seconds(n) for n in (1, 2, 3, 7, 1000)] == [5, 10, 20, 300, 300]


def test_failed_shard_fails_the_replica_with_backoff_and_stops_its_other_shards(
    run_tick, agent_inbox, django_capture_on_commit_callbacks
):
    make_node("gpu-a", gpus=2, fabric="ib-a")
    make_node("gpu-b", gpus=2, fabric="ib-a")
    make_model("big", gpus_per_node=2, nodes_per_replica=2)
    run_tick()
    head, worker = Shard.objects.select_related("node").order_by("rank")
    inbox_a, inbox_b = agent_inbox("gpu-a"), agent_inbox("gpu-b")

    before = timezone.now()
    report(worker.node, worker, "failed", message="CUDA out of memory", capture=django_capture_on_commit_callbacks)

    replica = Replica.objects.get()
    assert (replica.state, replica.failure_count, replica.last_error) == (
        ReplicaState.FAILED,
        1,
        "CUDA out of memory",
    )
    assert before + timedelta(seconds=5) <= replica.next_attempt_at <= timezone.now() + timedelta(seconds=5)
    assert Shard.objects.count() == 0 and GPUAssignment.objects.count() == 0
    assert inbox_a() == [{"type": "stop_shard", "v": 1, "epoch": 1, "shard_id": head.pk}]
    assert inbox_b() == []


def test_failed_replica_waits_for_its_backoff_then_is_placed_again(run_tick, django_capture_on_commit_callbacks):
    node = make_node("gpu-a")
    make_model("llama")
    run_tick()
    report(node, Shard.objects.get(), "failed", message="boom", capture=django_capture_on_commit_callbacks)
    failed_at = timezone.now()

    early = run_tick(now=failed_at + timedelta(seconds=1))
    assert (early.replicas_created, early.replicas_retried) == (0, 0)
    assert Replica.objects.get().state == ReplicaState.FAILED

    later = run_tick(now=failed_at + timedelta(seconds=6))
    assert (later.replicas_retried, later.replicas_placed) == (1, 1)
    replica = Replica.objects.get()
    assert replica.state == ReplicaState.STARTING

    report(node, replica.shards.get(), "failed", message="boom", capture=django_capture_on_commit_callbacks)
    replica.refresh_from_db()
    assert replica.failure_count == 2
    assert replica.next_attempt_at >= timezone.now() + timedelta(seconds=9)


def test_a_shard_that_never_starts_fails_its_replica(run_tick, settings):
    settings.LLMGW_SHARD_START_TIMEOUT_SECONDS = 60
    make_node("gpu-a")
    make_model("llama")
    run_tick()

    result = run_tick(now=timezone.now() + timedelta(seconds=61))

    assert result.replicas_failed == 1
    assert Replica.objects.get().last_error == "not ready within 60 s of placement"


def test_an_unanswered_start_is_sent_again(run_tick, agent_inbox, settings):
    settings.LLMGW_START_RESEND_SECONDS = 10
    make_node("gpu-a")
    make_model("llama")
    inbox = agent_inbox("gpu-a")
    run_tick()
    (first,) = inbox()

    assert run_tick(now=timezone.now() + timedelta(seconds=5)).starts_resent == 0
    assert run_tick(now=timezone.now() + timedelta(seconds=11)).starts_resent == 1
    assert inbox() == [first]


# --- demand ---------------------------------------------------------------------


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
    assert Replica.objects.get().state == ReplicaState.STOPPING
    assert inbox() == [{"type": "stop_shard", "v": 1, "epoch": 1, "shard_id": shard.pk}]


def test_replicas_above_max_are_stopped_pending_first(run_tick):
    model = make_model("llama", min_replicas=0, max_replicas=1)
    profile = model.profiles.get()
    Replica.objects.bulk_create(Replica(model=model, profile=profile) for _ in range(3))

    result = run_tick()

    assert result.replicas_deleted == 2
    assert Replica.objects.count() == 1


def ready_replicas(model, last_used_ago):
    """READY replicas (without shards) of `model`, one per entry: seconds since last use, or None = unknown."""
    now = timezone.now()
    return [
        Replica.objects.create(
            model=model,
            profile=model.profiles.get(),
            state=ReplicaState.READY,
            last_used=None if ago is None else now - timedelta(seconds=ago),
        )
        for ago in last_used_ago
    ]


def test_replicas_idle_past_the_timeout_are_stopped_down_to_min(run_tick):
    model = make_model("llama", min_replicas=2, max_replicas=3, idle_timeout_seconds=600)
    busy, idlest, idle = ready_replicas(model, [30, 3600, 900])

    result = run_tick()

    assert result.replicas_idle_stopped == 1
    assert set(Replica.objects.values_list("pk", flat=True)) == {busy.pk, idle.pk}


def test_a_replica_whose_last_use_is_unknown_is_never_stopped_for_idleness(run_tick):
    """DESIGN invariant 3: unknown is not idle."""
    model = make_model("llama", min_replicas=0, max_replicas=2, idle_timeout_seconds=60)
    unknown, idle = ready_replicas(model, [None, 120])

    result = run_tick()

    assert result.replicas_idle_stopped == 1
    assert list(Replica.objects.values_list("pk", flat=True)) == [unknown.pk]


def test_no_idle_timeout_means_replicas_stay(run_tick):
    model = make_model("llama", min_replicas=0, max_replicas=1, idle_timeout_seconds=None)
    ready_replicas(model, [10**6])

    assert run_tick().replicas_idle_stopped == 0
    assert Replica.objects.count() == 1


# --- usage (DESIGN invariant 3) ----------------------------------------------------


def test_usage_stamps_move_into_last_used_and_unknown_stays_unknown(run_tick):
    model = make_model("llama", min_replicas=2, max_replicas=2)
    run_tick()  # creates two (unplaceable) replicas
    used, unused = Replica.objects.order_by("id")
    stamp = datetime(2030, 1, 1, tzinfo=UTC)
    hub = get_hub()
    async_to_sync(hub.record_usage)({str(used.pk): stamp.timestamp(), "999999": stamp.timestamp()})

    result = run_tick()

    used.refresh_from_db()
    unused.refresh_from_db()
    assert used.last_used == stamp
    assert unused.last_used is None
    assert unused.idle().known is False
    assert (result.usage_updated, result.usage_forgotten) == (1, 1)
    assert "999999" not in hub.collect_usage()
    assert model.replicas.count() == 2


def test_a_replica_never_used_while_watched_is_idle_since_it_became_ready(run_tick):
    """DESIGN invariant 3: "never asked for" is known only if routers watched since it became ready."""
    model = make_model("llama", min_replicas=0, max_replicas=3, idle_timeout_seconds=600)
    hub = get_hub()
    async_to_sync(hub.keep_watching)(60)
    since = datetime.fromtimestamp(hub.watching_since(), tz=UTC)
    before_watch, after_watch, long_unused = ready_replicas(model, [None, None, None])
    Replica.objects.filter(pk=before_watch.pk).update(ready_at=since - timedelta(seconds=5))
    Replica.objects.filter(pk=after_watch.pk).update(ready_at=since + timedelta(seconds=1))

    result = run_tick(now=since + timedelta(seconds=2))

    assert result.usage_idle_since_ready == 1
    before_watch.refresh_from_db()
    after_watch.refresh_from_db()
    assert before_watch.last_used is None  # became ready before anyone watched: unknown
    assert after_watch.last_used == after_watch.ready_at
    assert long_unused.last_used is None  # never became ready (no ready_at)

    # Unused past the idle timeout, it is now stoppable like any known-idle replica.
    result = run_tick(now=since + timedelta(seconds=1200))
    assert result.replicas_idle_stopped == 1
    assert not Replica.objects.filter(pk=after_watch.pk).exists()


def test_without_a_watch_unused_replicas_stay_unknown(run_tick):
    model = make_model("llama", min_replicas=0, max_replicas=1, idle_timeout_seconds=60)
    (replica,) = ready_replicas(model, [None])
    Replica.objects.filter(pk=replica.pk).update(ready_at=timezone.now())

    assert run_tick().usage_idle_since_ready == 0
    replica.refresh_from_db()
    assert replica.last_used is None


def test_an_older_usage_stamp_never_moves_last_used_back(run_tick):
    make_model("llama")
    run_tick()
    replica = Replica.objects.get()
    newer = datetime(2030, 1, 1, tzinfo=UTC)
    Replica.objects.filter(pk=replica.pk).update(last_used=newer)
    get_hub()._stamps[str(replica.pk)] = (newer - timedelta(hours=1)).timestamp()

    assert run_tick().usage_updated == 0
    replica.refresh_from_db()
    assert replica.last_used == newer


# --- node liveness ----------------------------------------------------------------


def test_silent_node_becomes_unreachable_then_lost_and_its_replicas_fail(run_tick, settings):
    settings.LLMGW_UNREACHABLE_AFTER_SECONDS, settings.LLMGW_LOST_AFTER_SECONDS = 20, 120
    node = make_node("gpu-a")
    make_model("llama")
    run_tick()
    now = timezone.now()

    assert run_tick(now=now + timedelta(seconds=30)).nodes_unreachable == 1
    node.refresh_from_db()
    assert node.state == NodeState.UNREACHABLE
    assert Replica.objects.get().state == ReplicaState.STARTING

    lost = run_tick(now=now + timedelta(seconds=130))
    node.refresh_from_db()
    assert (lost.nodes_lost, node.state) == (1, NodeState.LOST)
    assert Shard.objects.count() == 0 and GPUAssignment.objects.count() == 0
    replica = Replica.objects.get()
    assert (replica.state, replica.last_error) == (ReplicaState.FAILED, "node lost: no heartbeat")


def test_a_new_leader_declares_no_node_lost_within_one_unreachable_window(leader, run_tick, settings):
    settings.LLMGW_UNREACHABLE_AFTER_SECONDS, settings.LLMGW_LOST_AFTER_SECONDS = 20, 120
    node = make_node("gpu-a")
    Node.objects.filter(pk=node.pk).update(last_seen=timezone.now() - timedelta(seconds=600))
    leader.leader_since = timezone.now()

    result = run_tick()

    node.refresh_from_db()
    assert (result.nodes_lost, node.state) == (0, NodeState.UNREACHABLE)
    leader.leader_since = timezone.now() - timedelta(seconds=21)
    assert run_tick().nodes_lost == 1


# --- leadership -------------------------------------------------------------------


def test_a_non_leader_tick_does_nothing(django_capture_on_commit_callbacks):
    make_node("gpu-a")
    make_model("llama")
    try_acquire(settings.LLMGW_LEASE_NAME, "someone-else", 60)

    with django_capture_on_commit_callbacks(execute=True):
        result = tick(leadership=Leadership(ttl=60))

    assert result.leader is False
    assert Replica.objects.count() == 0
    assert async_to_sync(get_hub().read_endpoints)() is None


class PausedLeadership(Leadership):
    """A leader whose last renew succeeded before it paused past its lease: it still believes it leads."""

    def renew(self):
        return self.held


def test_a_leader_that_paused_past_its_lease_commits_nothing(leader):
    make_node("gpu-a")
    make_model("llama")
    paused = PausedLeadership(ttl=60)
    paused.owner, paused.held, paused.epoch = leader.owner, True, leader.epoch
    from reconciler.models import Lease

    Lease.objects.update(expires_at=0)
    assert Leadership(ttl=60).renew()  # another process takes over at epoch 2

    result = tick(leadership=paused)

    assert result.leader is False
    assert Replica.objects.count() == 0
    assert current_epoch() == 2


# --- stopping and agent reconnects ----------------------------------------------------


def test_stopping_a_replica_sends_stop_and_deletes_it_when_its_shards_stop(
    run_tick, agent_inbox, django_capture_on_commit_callbacks
):
    node = make_node("gpu-a")
    make_model("llama", min_replicas=0)
    async_to_sync(get_hub().request_activation)("llama")
    run_tick()
    replica, shard = Replica.objects.get(), Shard.objects.get()
    inbox = agent_inbox("gpu-a")

    with django_capture_on_commit_callbacks(execute=True):
        stop_replica(replica)
    assert Replica.objects.get().state == ReplicaState.STOPPING
    run_tick()
    assert inbox() == [{"type": "stop_shard", "v": 1, "epoch": 1, "shard_id": shard.pk}]
    assert run_tick().stops_sent == 0  # not re-sent before the resend interval

    report(node, shard, "stopped", capture=django_capture_on_commit_callbacks)
    assert Replica.objects.count() == 0 and GPUAssignment.objects.count() == 0


def test_stopping_a_replica_without_shards_deletes_it_at_once():
    model = make_model("llama")
    replica = Replica.objects.create(model=model, profile=model.profiles.get())
    stop_replica(replica)
    assert Replica.objects.count() == 0


def test_agent_hello_keeps_known_shards_stops_orphans_and_fails_missing_ones(
    run_tick, agent_inbox, django_capture_on_commit_callbacks
):
    node = make_node("gpu-a")
    make_model("kept")
    make_model("gone")
    run_tick()
    kept = Shard.objects.get(replica__model__name="kept")
    gone = Shard.objects.get(replica__model__name="gone")
    Shard.objects.filter(pk=gone.pk).update(state=ShardState.STARTING)  # the agent had begun starting it
    inbox = agent_inbox("gpu-a")

    with django_capture_on_commit_callbacks(execute=True):
        reconcile_reported_shards(
            node,
            [
                {"shard_id": kept.pk, "replica_id": kept.replica_id, "state": "ready", "port": kept.port},
                {"shard_id": 424242, "replica_id": 7, "state": "ready", "port": 29999},
            ],
        )

    assert Replica.objects.get(model__name="kept").state == ReplicaState.READY
    failed = Replica.objects.get(model__name="gone")
    assert failed.state == ReplicaState.FAILED and not Shard.objects.filter(pk=gone.pk).exists()
    assert inbox() == [{"type": "stop_shard", "v": 1, "epoch": 1, "shard_id": 424242}]


def test_a_start_the_agent_never_answered_is_sent_again_after_its_hello_not_failed(
    run_tick, agent_inbox, django_capture_on_commit_callbacks
):
    """The start may have been sent while the agent was between connections."""
    node = make_node("gpu-a")
    make_model("llama")
    run_tick()
    shard = Shard.objects.get()
    assert shard.state == ShardState.ASSIGNED
    inbox = agent_inbox("gpu-a")

    with django_capture_on_commit_callbacks(execute=True):
        reconcile_reported_shards(node, [])
    run_tick()

    replica = Replica.objects.get()
    assert replica.state == ReplicaState.STARTING and replica.failure_count == 0
    assert [(c["type"], c["shard_id"]) for c in inbox()] == [("start_shard", shard.pk)]


# --- bounded work -----------------------------------------------------------------


def fleet(size):
    for i in range(size):
        make_node(f"gpu-{i:02d}", gpus=2, fabric="ib-a")
        make_model(f"model-{i:02d}", gpus_per_node=2)
    make_model("pair", gpus_per_node=2, nodes_per_replica=2, min_replicas=0)


def tick_queries(run_tick, now=None):
    with CaptureQueriesContext(connection) as queries:
        run_tick(now=now)
    return len(queries)


def test_a_tick_runs_the_same_number_of_queries_for_2_and_20_nodes(run_tick, django_assert_max_num_queries):
    counts = {}
    for size in (2, 20):
        Replica.objects.all().delete()
        Model.objects.all().delete()
        Node.objects.all().delete()
        fleet(size)
        async_to_sync(get_hub().request_activation)("pair")
        placing = tick_queries(run_tick)
        assert Replica.objects.filter(state=ReplicaState.STARTING).count() == size
        steady = tick_queries(run_tick)
        with django_assert_max_num_queries(30):
            run_tick()
        counts[size] = (placing, steady)
    assert counts[2] == counts[20]
