"""cluster_summary(): the numbers every operator surface shows, checked against the rows."""

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from dashboard.summary import cluster_summary
from inventory.choices import GPUHealth, NodeState
from reconciler.choices import Hold, ReplicaState
from reconciler.demand.idle import Idle
from reconciler.models import Lease, Replica
from reconciler.placement.eviction import MAKING_ROOM
from tests.fleet import make_model, make_node, make_replica, set_gpu

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(settings):
    """A small fleet with every GPU state; returns the named rows."""
    settings.LLMGW_GPU_QUARANTINE_SECONDS = 300
    now = timezone.now()
    a = make_node("node-a", gpus=4, fabric="ib-a")  # 2 used, 1 unhealthy AND assigned, 1 free
    make_node("node-b", gpus=4, fabric="ib-a")  # all free
    c = make_node("node-c", gpus=4, fabric="ib-b")  # 1 in quarantine
    make_node("node-d", gpus=4, fabric="ib-b", state=NodeState.UNREACHABLE)  # 4 unavailable
    make_node("node-e", gpus=4, fabric="ib-b", state=NodeState.LOST)  # not counted
    make_node("node-f", gpus=4, fabric="ib-a", schedulable=False)  # cordoned: 4 unavailable
    make_node("node-l", fabric="", gpu_class="L40S", gpus=2)  # all free, no fabric
    set_gpu(c, 0, healthy_since=now - timedelta(seconds=10))
    llama = make_model("llama-70b", gpus_per_node=2, min_replicas=0)
    llama_profile = llama.profiles.get()
    big = make_model("big-405b", gpus_per_node=4, nodes_per_replica=2, min_replicas=0)
    big_profile = big.profiles.get()
    make_model("off", enabled=False, min_replicas=0)
    busy = make_replica(
        llama_profile, placement=[(a, [0, 1])], last_used=now - timedelta(seconds=192), endpoint="http://a:21000"
    )
    unknown = make_replica(llama_profile, state=ReplicaState.STARTING, placement=[(a, [2])])
    set_gpu(a, 2, health=GPUHealth.UNHEALTHY)
    reason = "needs 2 whole H100-80GB nodes on one fabric; free: 1 on ib-a"
    make_replica(big_profile, state=ReplicaState.PENDING, error=reason)
    make_replica(big_profile, state=ReplicaState.PENDING, error=reason)
    make_replica(llama_profile, state=ReplicaState.PENDING)
    make_replica(llama_profile, state=ReplicaState.STOPPING)
    make_replica(llama_profile, state=ReplicaState.FAILED)
    return {"now": now, "busy": busy, "unknown": unknown, "reason": reason, "llama": llama, "big": big}


def test_capacity_counts_used_free_unhealthy_and_unavailable_per_class(fleet):
    summary = cluster_summary(fleet["now"]).as_json()
    assert summary["capacity"] == [
        # node-a: 2 used, 1 unhealthy though assigned, 1 free; node-b: 4 free; node-c: 1 quarantined, 3 free;
        # node-d unreachable and node-f cordoned: 8 unavailable; node-e lost: absent.
        {"gpu_class": "H100-80GB", "total": 20, "used": 2, "free": 8, "unhealthy": 2, "unavailable": 8},
        {"gpu_class": "L40S", "total": 2, "used": 0, "free": 2, "unhealthy": 0, "unavailable": 0},
    ]


def test_capacity_states_add_up_to_total_for_every_class(fleet):
    for row in cluster_summary(fleet["now"]).as_json()["capacity"]:
        assert row["total"] == row["used"] + row["free"] + row["unhealthy"] + row["unavailable"]


def test_gpu_leaves_quarantine_after_the_quarantine_period(fleet, settings):
    settings.LLMGW_GPU_QUARANTINE_SECONDS = 5
    h100 = cluster_summary(fleet["now"]).as_json()["capacity"][0]
    assert (h100["unhealthy"], h100["free"]) == (1, 9)


def test_free_whole_nodes_are_ready_schedulable_nodes_with_every_gpu_of_the_class_free(fleet):
    assert cluster_summary(fleet["now"]).as_json()["free_nodes"] == [
        {"fabric": "", "gpu_class": "L40S", "whole_free_nodes": 1, "nodes": ["node-l"]},
        {"fabric": "ib-a", "gpu_class": "H100-80GB", "whole_free_nodes": 1, "nodes": ["node-b"]},
        {"fabric": "ib-b", "gpu_class": "H100-80GB", "whole_free_nodes": 0, "nodes": []},
    ]


def test_node_and_replica_counts_match_the_rows(fleet):
    summary = cluster_summary(fleet["now"]).as_json()
    assert summary["nodes"] == {"total": 7, "ready": 5, "unreachable": 1, "lost": 1, "new": 0, "cordoned": 1}
    assert summary["replicas"] == {
        "pending": 3, "starting": 1, "ready": 1, "sleeping": 0, "waking": 0, "stopping": 1, "failed": 1, "total": 7
    }  # fmt: skip


def test_models_count_wanted_without_stopping_and_ready_only_ready(fleet):
    no_adapters = {"registered": 0, "loaded": 0, "loading": 0, "slots": 0}
    no_loads = {"loads": 0, "failures": 0, "load_seconds": None}
    assert cluster_summary(fleet["now"]).as_json()["models"] == [
        {
            "name": "big-405b",
            "enabled": True,
            "wanted": 2,
            "ready": 0,
            "adapters": no_adapters,
            "adapter_loading": no_loads,
        },
        {
            "name": "llama-70b",
            "enabled": True,
            "wanted": 4,
            "ready": 1,
            "adapters": no_adapters,
            "adapter_loading": no_loads,
        },
        {
            "name": "off",
            "enabled": False,
            "wanted": 0,
            "ready": 0,
            "adapters": no_adapters,
            "adapter_loading": no_loads,
        },
    ]


def test_unplaceable_groups_pending_replicas_by_model_and_reason(fleet):
    assert cluster_summary(fleet["now"]).as_json()["unplaceable"] == [
        {"model": "big-405b", "reason": fleet["reason"], "pending": 2, "holding": ""}
    ]


def test_replica_list_shows_nodes_gpus_and_known_idle_time(fleet):
    rows = {r["id"]: r for r in cluster_summary(fleet["now"]).as_json()["replica_list"]}
    busy = rows[fleet["busy"].pk]
    assert busy["model"] == "llama-70b"
    assert busy["nodes"] == ["node-a"]
    assert busy["gpus"] == 2
    assert busy["endpoint"] == "http://a:21000"
    assert busy["idle_known"] is True
    assert busy["idle_seconds"] == pytest.approx(192, abs=0.01)
    assert str(Idle.from_json(busy["idle_seconds"], busy["idle_known"])) == "3m12s"


def test_unknown_last_use_is_negative_idle_and_not_known(fleet):
    row = next(r for r in cluster_summary(fleet["now"]).as_json()["replica_list"] if r["id"] == fleet["unknown"].pk)
    assert row["last_used"] is None
    assert row["idle_seconds"] < 0
    assert row["idle_known"] is False
    assert str(Idle.from_json(row["idle_seconds"], row["idle_known"])) == "-"


def test_replica_list_is_sorted_by_id(fleet):
    ids = [r["id"] for r in cluster_summary(fleet["now"]).as_json()["replica_list"]]
    assert ids == sorted(ids) and len(ids) == 7


def test_summary_is_json_ready(fleet):
    summary = cluster_summary(fleet["now"]).as_json()
    assert json.loads(json.dumps(summary)) == summary


def test_leader_is_null_without_a_lease_row():
    assert cluster_summary().as_json()["leader"] is None


def test_leader_shows_owner_epoch_and_negative_expiry_when_expired(settings):
    now = timezone.now()
    Lease.objects.create(name=settings.LLMGW_LEASE_NAME, owner="cp-1f3a", epoch=7, expires_at=now.timestamp() - 4.5)
    assert cluster_summary(now).as_json()["leader"] == {"owner": "cp-1f3a", "epoch": 7, "expires_in_seconds": -4.5}


def _grow_fleet(nodes: int):
    profile = make_model(f"m{nodes}", gpus_per_node=2, min_replicas=0).profiles.get()
    for i in range(nodes):
        node = make_node(f"n{nodes}-{i}", gpus=4, fabric=f"ib-{i % 3}")
        make_replica(profile, placement=[(node, [0, 1])], last_used=timezone.now() if i % 2 else None)
        make_replica(profile, state=ReplicaState.PENDING, error="no room")


def test_summary_runs_the_same_number_of_queries_for_2_and_20_nodes(django_assert_num_queries):
    _grow_fleet(2)
    # 11 for the summary (weights, adapter loads, continuations, what users felt, stages); usage unknown: the usage
    # watch.
    with django_assert_num_queries(12):
        small = cluster_summary().as_json()
    _grow_fleet(20)
    with django_assert_num_queries(12):
        large = cluster_summary().as_json()
    assert small["nodes"]["total"] == 2 and large["nodes"]["total"] == 22


def test_a_pending_replica_is_unplaceable_by_its_hold_not_by_its_note():
    def pending(name, note, hold):
        replica = make_replica(make_model(name).profiles.get(), state=ReplicaState.PENDING, error=note)
        Replica.objects.filter(pk=replica.pk).update(hold=hold)

    pending("held", "stopping replica 7", Hold.MAKING_ROOM)
    pending("waits", "no node has GPU class X", Hold.WAITING_FOR_NODES)
    pending("stuck", MAKING_ROOM + "in words only", Hold.NONE)  # reads like a hold, holds nothing
    summary = cluster_summary().as_json()
    assert summary["unplaceable_models"] == ["stuck"]
    # Every note is still shown to operators, holding or not.
    assert {u["model"] for u in summary["unplaceable"]} == {"held", "waits", "stuck"}
