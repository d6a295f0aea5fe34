"""Shard reports that make replicas ready, and the endpoint table the tick publishes."""

from datetime import timedelta

import msgspec
import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.utils import timezone

from catalog.models import Alias, Model
from hub import get_hub
from hub.contracts import EndpointRow, EndpointTable, ModelEntry
from inventory.choices import NodeState
from reconciler.choices import Hold, ReplicaState, ShardState
from reconciler.endpoints import build_endpoint_table
from reconciler.models import Replica, Shard
from reconciler.placement.eviction import WAITING_FOR_NODES
from reconciler.signals import work_pending
from tests.fleet import make_model, make_node

pytestmark = pytest.mark.django_db


def published(hub):
    """The endpoint table the hub hands routers, decoded."""
    return msgspec.json.decode(async_to_sync(hub.read_endpoints)(), type=EndpointTable)


def test_ready_report_makes_the_replica_ready_and_the_next_tick_publishes_it(
    run_tick, django_capture_on_commit_callbacks, shard_report
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

    shard_report(node, shard, "starting")
    assert Shard.objects.get().state == ShardState.STARTING
    Replica.objects.filter(pk=replica.pk).update(started_at=timezone.now() - timedelta(seconds=42))
    shard_report(node, shard, "ready", port=20000)

    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY
    assert replica.endpoint_url == "http://127.0.0.1:20000"
    assert replica.ready_at is not None
    work_pending.disconnect(dispatch_uid="test-woken")
    assert woken, "a replica turning ready must wake the ticker"
    assert run_tick().published is True
    table = published(hub)
    assert table.models == {
        "llama": ModelEntry(aliases=["llama-latest"], start_seconds=42.0, pools=["gold"], token_ids=True)
    }
    assert table.endpoints == [
        EndpointRow(
            replica_id=str(replica.pk), model="llama", url="http://127.0.0.1:20000", priority=5, weight=3, pool="gold"
        )
    ]


def test_an_unchanged_endpoint_table_is_published_once(run_tick):
    """DESIGN invariant 7."""
    make_node("gpu-a")
    make_model("llama", min_replicas=0)
    assert run_tick().published is True
    first = async_to_sync(get_hub().read_endpoints)()
    assert run_tick().published is False
    assert async_to_sync(get_hub().read_endpoints)() is first


def test_the_table_says_which_models_streams_are_continued_and_by_token_ids():
    make_model("vllm-only", min_replicas=0, engine="vllm")
    make_model("off", min_replicas=0, engine="mock")
    Model.objects.filter(name="off").update(continue_streams=False)
    mixed = make_model("mixed", min_replicas=0, engine="vllm")
    mixed.profiles.create(gpu_class="L40S-48GB", engine="llamacpp", order=1)
    models = build_endpoint_table().models
    assert (models["vllm-only"].continue_streams, models["vllm-only"].token_ids) == (True, True)
    assert (models["off"].continue_streams, models["off"].token_ids) == (False, True)
    # One engine that gives no token ids: its replicas' streams are continued from their text.
    assert (models["mixed"].continue_streams, models["mixed"].token_ids) == (True, False)


def test_the_table_says_which_models_engines_all_schedule_by_priority():
    policy = ["--max-num-seqs", "8", "--scheduling-policy", "priority"]
    make_model("by-priority", min_replicas=0, engine="vllm", engine_args=policy)
    make_model("inline", min_replicas=0, engine="vllm", engine_args=["--scheduling_policy=priority"])
    make_model("fcfs", min_replicas=0, engine="vllm", engine_args=[*policy, "--scheduling-policy", "fcfs"])
    mixed = make_model("mixed", min_replicas=0, engine="vllm", engine_args=policy)
    mixed.profiles.create(gpu_class="L40S-48GB", engine="sglang", order=1, engine_args=policy)
    models = build_endpoint_table().models
    found = {name: models[name].priority_scheduling for name in ("by-priority", "inline", "fcfs", "mixed")}
    # The last flag given wins, as vLLM's parser takes it; SGLang takes no such flag: not every engine would.
    assert found == {"by-priority": True, "inline": True, "fcfs": False, "mixed": False}


def test_endpoint_table_lists_enabled_models_with_profiles_in_eight_queries(django_assert_max_num_queries):
    make_model("llama", min_replicas=0)
    make_model("off", min_replicas=0, enabled=False)
    Model.objects.create(name="bare", source="org/bare")
    with django_assert_max_num_queries(8):  # the seventh and eighth: adapters, none here
        table = build_endpoint_table()
    assert table == EndpointTable(
        models={"llama": ModelEntry(aliases=[], pools=["default"], token_ids=True)}, endpoints=[]
    )


def test_endpoint_table_says_why_a_wanted_model_cannot_be_placed(run_tick):
    make_model("llama", min_replicas=1)  # no node has its GPU class

    run_tick()

    assert build_endpoint_table().models["llama"] == ModelEntry(
        aliases=[], unplaceable="no node has GPU class H100-80GB", pools=["default"], token_ids=True
    )


def test_start_times_are_learned_per_profile_as_a_moving_average(
    run_tick, django_capture_on_commit_callbacks, shard_report
):
    node = make_node("gpu-a")
    model = make_model("llama", min_replicas=2, max_replicas=2)
    run_tick()
    first, second = Replica.objects.order_by("id")
    for replica, took in ((first, 30), (second, 10)):
        Replica.objects.filter(pk=replica.pk).update(started_at=timezone.now() - timedelta(seconds=took))
        shard_report(node, replica.shards.get(), "ready")

    assert model.profiles.get().start_seconds == pytest.approx(20.0, abs=0.5)  # (30 + 10) / 2


def test_multi_node_replica_is_ready_only_when_every_shard_is(
    run_tick, django_capture_on_commit_callbacks, shard_report
):
    make_node("gpu-a", gpus=2, fabric="ib-a", address="10.0.0.1")
    make_node("gpu-b", gpus=2, fabric="ib-a", address="10.0.0.2")
    make_model("big", gpus_per_node=2, nodes_per_replica=2)
    run_tick()
    head, worker = Shard.objects.select_related("node").order_by("rank")

    shard_report(worker.node, worker, "ready")
    assert Replica.objects.get().state == ReplicaState.STARTING
    shard_report(head.node, head, "ready")
    assert Replica.objects.get().endpoint_url == f"http://10.0.0.1:{head.port}"


def test_a_node_cannot_report_on_another_nodes_shard(run_tick, django_capture_on_commit_callbacks, shard_report):
    make_node("gpu-a")
    other = make_node("gpu-b", gpus=0)
    make_model("llama")
    run_tick()
    shard = Shard.objects.get()

    shard_report(other, shard, "ready")

    assert Shard.objects.get().state == ShardState.ASSIGNED
    assert Replica.objects.get().state == ReplicaState.STARTING


def test_a_catalog_change_is_published_when_it_commits_not_at_the_next_tick(django_capture_on_commit_callbacks):
    hub = get_hub()
    with django_capture_on_commit_callbacks(execute=True):
        model = make_model("new-model")
        Alias.objects.create(model=model, name="newest")
    table = published(hub)
    assert table.models["new-model"] == ModelEntry(aliases=["newest"], pools=["default"], token_ids=True)

    with django_capture_on_commit_callbacks(execute=True):
        Model.objects.filter(pk=model.pk).delete()
    assert "new-model" not in published(hub).models


def test_a_transaction_saving_many_catalog_rows_publishes_once(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        for name in ("one", "two", "three"):
            make_model(name)
            Alias.objects.create(model=Model.objects.get(name=name), name=f"{name}-alias")
    assert len(callbacks) == 1


def test_a_new_leader_holds_requests_while_enrolled_nodes_have_not_reported_in(run_tick, leader):
    """Right after start, "no node has GPU class X" may only mean "not yet": routers hold, not refuse."""
    make_node("gpu-a")
    make_node("gpu-c", gpu_class="L40S-48GB", state=NodeState.NEW)  # enrolled, its agent not connected yet
    make_model("qwen", gpu_class="L40S-48GB")
    leader.leader_since = timezone.now()

    run_tick()

    note = Replica.objects.get().placement_note
    assert note.startswith(WAITING_FOR_NODES)
    assert Replica.objects.get().hold == Hold.WAITING_FOR_NODES
    assert build_endpoint_table().models["qwen"].unplaceable is None

    # A heartbeat window later, what still finds no room is unplaceable.
    run_tick(now=timezone.now() + timedelta(seconds=settings.LLMGW_UNREACHABLE_AFTER_SECONDS + 1))
    assert build_endpoint_table().models["qwen"].unplaceable == (
        "every node with GPU class L40S-48GB is out of service (enrolled but never connected: gpu-c)"
    )
    assert Replica.objects.get().hold == Hold.NONE


def test_once_every_enrolled_node_has_reported_in_nothing_waits(run_tick, leader):
    make_node("gpu-a")
    make_model("qwen", gpu_class="L40S-48GB")
    leader.leader_since = timezone.now()

    run_tick()

    assert Replica.objects.get().placement_note == "no node has GPU class L40S-48GB"
