"""The summary's "what can I stop": ranked known-idle candidates, what each frees and unblocks, idle-held GPUs, usage."""

from datetime import timedelta

import pytest
from django.utils import timezone

from catalog.models import Profile
from dashboard.summary import cluster_summary
from reconciler.choices import Hold, ReplicaState
from reconciler.models import Lease, Replica, Shard
from reconciler.placement.eviction import MAKING_ROOM
from tests.fleet import make_model, make_node, make_replica, watch_usage

pytestmark = pytest.mark.django_db

L40S = "L40S-48GB"


NOW = timezone.now()
"""One clock for the stamps and the summary, so equal products of GPUs and idle seconds are really equal."""


def ago(seconds):
    return NOW - timedelta(seconds=seconds)


@pytest.fixture
def usage_known():
    watch_usage(known_since=ago(86400))


def stoppable():
    return cluster_summary(NOW).as_json()["stoppable"]


def ids(entries):
    return [e["replica"] for e in entries]


def test_candidates_rank_by_gpu_seconds_held_idle_then_eviction_order(usage_known):
    a = make_node("gpu-a", fabric="ib-a")
    b = make_node("gpu-b", fabric="ib-a")
    eight = make_model("eight", gpus_per_node=8, min_replicas=0, max_replicas=3).profiles.get()
    four = make_model("four", gpus_per_node=4, min_replicas=0, max_replicas=3).profiles.get()
    two = make_model("two", gpus_per_node=2, min_replicas=0, max_replicas=3, priority=5).profiles.get()
    wide = make_replica(eight, placement=[(a, range(8))], last_used=ago(600))  # 4,800 GPU-seconds
    narrow = make_replica(two, placement=[(b, [0, 1])], last_used=ago(3000))  # 6,000
    half = make_replica(four, placement=[(b, [2, 3, 4, 5])], last_used=ago(1200))  # 4,800, idle longer than `wide`
    entries = stoppable()
    assert ids(entries) == [narrow.pk, half.pk, wide.pk]
    assert entries[0] == {
        "replica": narrow.pk,
        "model": "two",
        "gpu_class": "H100-80GB",
        "gpus": 2,
        "nodes": ["gpu-b"],
        "idle_seconds": pytest.approx(3000, abs=5),
        "idle": "50m00s",
        "frees": "2 H100-80GB GPUs on gpu-b",
        "unblocks": [],
    }


def test_equal_gpu_seconds_go_in_eviction_order_lowest_priority_first(usage_known):
    a = make_node("gpu-a", fabric="ib-a")
    high = make_model("high", gpus_per_node=4, min_replicas=0, priority=9).profiles.get()
    low = make_model("low", gpus_per_node=4, min_replicas=0, priority=1).profiles.get()
    first = make_replica(high, placement=[(a, range(4))], last_used=ago(900))
    second = make_replica(low, placement=[(a, range(4, 8))], last_used=ago(900))
    assert ids(stoppable()) == [second.pk, first.pk]


def test_only_known_idle_replicas_are_candidates(usage_known):
    a = make_node("gpu-a", fabric="ib-a")
    profile = make_model("m", gpus_per_node=2, min_replicas=0, max_replicas=4).profiles.get()
    unknown = make_replica(profile, placement=[(a, [0, 1])], last_used=None)
    recent = make_replica(profile, placement=[(a, [2, 3])], last_used=ago(5))  # under LLMGW_EVICT_MIN_IDLE_SECONDS
    starting = make_replica(profile, state=ReplicaState.STARTING, placement=[(a, [4, 5])], last_used=ago(9000))
    idle = make_replica(profile, placement=[(a, [6, 7])], last_used=ago(900))
    entries = stoppable()
    assert ids(entries) == [idle.pk]
    assert {unknown.pk, recent.pk, starting.pk}.isdisjoint(ids(entries))


def test_a_model_is_never_taken_below_its_min_replicas(usage_known):
    a = make_node("gpu-a", fabric="ib-a")
    kept = make_model("kept", gpus_per_node=2, min_replicas=2, max_replicas=3).profiles.get()
    make_replica(kept, placement=[(a, [0, 1])], last_used=ago(900))
    make_replica(kept, placement=[(a, [2, 3])], last_used=ago(800))
    assert stoppable() == []
    third = make_replica(kept, placement=[(a, [4, 5])], last_used=ago(5000))
    # One spare above the min: one replica is offered (the first in eviction order), never two.
    assert ids(stoppable()) == [third.pk]


def test_a_replica_with_running_requests_is_never_a_candidate(usage_known):
    a = make_node("gpu-a", fabric="ib-a")
    profile = make_model("m", gpus_per_node=4, min_replicas=0, max_replicas=2).profiles.get()
    busy = make_replica(profile, placement=[(a, range(4))], last_used=ago(7200))
    quiet = make_replica(profile, placement=[(a, range(4, 8))], last_used=ago(600))
    Shard.objects.filter(replica=busy).update(running=3)
    Shard.objects.filter(replica=quiet).update(running=0)
    assert ids(stoppable()) == [quiet.pk]


def test_frees_names_whole_nodes_per_fabric_partial_gpus_and_no_fabric(usage_known):
    a = make_node("gpu-a", fabric="ib-a")
    b = make_node("gpu-b", fabric="ib-a")
    c = make_node("gpu-c", fabric="ib-b")
    d = make_node("gpu-d", fabric="ib-b")
    e = make_node("gpu-e", gpus=2, gpu_class=L40S)
    whole = make_model("whole", gpus_per_node=8, min_replicas=0).profiles.get()
    part = make_model("part", gpus_per_node=4, min_replicas=0).profiles.get()
    multi = make_model("multi", gpus_per_node=8, nodes_per_replica=2, min_replicas=0).profiles.get()
    small = make_model("small", gpus_per_node=2, min_replicas=0, gpu_class=L40S).profiles.get()
    r_whole = make_replica(whole, placement=[(a, range(8))], last_used=ago(600))
    r_part = make_replica(part, placement=[(b, range(4))], last_used=ago(600))
    make_replica(part, placement=[(b, range(4, 8))], last_used=None)  # keeps gpu-b from becoming whole
    r_multi = make_replica(multi, placement=[(c, range(8)), (d, range(8))], last_used=ago(600))
    r_small = make_replica(small, placement=[(e, [0, 1])], last_used=ago(600))
    frees = {e["replica"]: e["frees"] for e in stoppable()}
    assert frees == {
        r_whole.pk: "a whole H100-80GB node on ib-a",
        r_part.pk: "4 H100-80GB GPUs on gpu-b",
        r_multi.pk: "2 whole H100-80GB nodes on ib-b",
        r_small.pk: "a whole L40S-48GB node (no fabric)",
    }


def test_frees_counts_a_cordoned_node_as_not_schedulable(usage_known):
    a = make_node("gpu-a", fabric="ib-a", schedulable=False)
    profile = make_model("m", gpus_per_node=8, min_replicas=0).profiles.get()
    make_replica(profile, placement=[(a, range(8))], last_used=ago(600))
    assert stoppable()[0]["frees"] == "8 H100-80GB GPUs on gpu-a (not schedulable now)"


def pending(model, error, hold=Hold.NONE):
    replica = make_replica(model.profiles.order_by("order").first(), state=ReplicaState.PENDING, error=error)
    Replica.objects.filter(pk=replica.pk).update(hold=hold)
    return replica


def test_stopping_the_replica_holding_the_rest_of_a_node_unblocks_an_eight_gpu_model(usage_known):
    a = make_node("gpu-a", fabric="ib-a")
    b = make_node("gpu-b", fabric="ib-a")
    six = make_model("six", gpus_per_node=6, min_replicas=0).profiles.get()
    two = make_model("two", gpus_per_node=2, min_replicas=0, max_replicas=2).profiles.get()
    big = make_model("big", gpus_per_node=8, min_replicas=0)
    rest = make_replica(six, placement=[(a, range(6))], last_used=ago(600))  # gpu-a: 2 free beside it
    little = make_replica(two, placement=[(b, [0, 1])], last_used=ago(600))
    make_replica(two, placement=[(b, [2, 3])], last_used=None)  # gpu-b stays short of 8 whatever is stopped
    pending(big, "needs 8×H100-80GB on one node; most free on one node: 4 (gpu-b)")
    unblocks = {e["replica"]: e["unblocks"] for e in stoppable()}
    assert unblocks == {rest.pk: ["big"], little.pk: []}


def test_a_fallback_profile_counts_and_making_room_does_not(usage_known):
    make_node("gpu-a", fabric="ib-a")  # 8 H100 free: 16 do not fit anywhere
    c = make_node("gpu-c", gpus=2, gpu_class=L40S)
    small = make_model("small", gpus_per_node=2, min_replicas=0, gpu_class=L40S).profiles.get()
    held = make_replica(small, placement=[(c, [0, 1])], last_used=ago(600))
    flex = make_model("flex", gpus_per_node=8, nodes_per_replica=2, min_replicas=0)
    Profile.objects.create(model=flex, order=1, gpu_class=L40S, gpus_per_node=2)
    pending(flex, "H100-80GB×8×2: 1 of 2 nodes free; L40S-48GB×2: most free on one node: 0")
    waiting = make_model("waiting", gpus_per_node=2, min_replicas=0, gpu_class=L40S)
    pending(waiting, MAKING_ROOM + "stopping replica 7", hold=Hold.MAKING_ROOM)
    [entry] = stoppable()
    assert entry["replica"] == held.pk and entry["unblocks"] == ["flex"]


def test_a_multi_node_model_is_unblocked_when_the_stop_completes_its_fabric(usage_known):
    a = make_node("gpu-a", fabric="ib-a")
    make_node("gpu-b", fabric="ib-a")  # already whole
    c = make_node("gpu-c", fabric="ib-b")
    make_node("gpu-d", fabric="ib-c")  # whole, but alone on its fabric
    one = make_model("one", gpus_per_node=8, min_replicas=0, max_replicas=2).profiles.get()
    on_a = make_replica(one, placement=[(a, range(8))], last_used=ago(600))
    on_c = make_replica(one, placement=[(c, range(8))], last_used=ago(600))
    pending(make_model("pair", gpus_per_node=8, nodes_per_replica=2, min_replicas=0), "needs 2 whole nodes")
    unblocks = {e["replica"]: e["unblocks"] for e in stoppable()}
    assert unblocks == {on_a.pk: ["pair"], on_c.pk: []}


def test_a_model_that_fits_already_is_not_said_to_be_unblocked(usage_known):
    make_node("gpu-a", fabric="ib-a")  # whole: the pending model's error is stale
    b = make_node("gpu-b", fabric="ib-a")
    m = make_model("m", gpus_per_node=8, min_replicas=0).profiles.get()
    make_replica(m, placement=[(b, range(8))], last_used=ago(600))
    pending(make_model("late", gpus_per_node=8, min_replicas=0), "needs 8×H100-80GB on one node")
    assert stoppable()[0]["unblocks"] == []


def test_idle_held_gpus_counts_known_idle_over_an_hour_per_class(usage_known):
    a = make_node("gpu-a", fabric="ib-a")
    make_node("gpu-l", gpus=2, gpu_class=L40S)
    make_node("gpu-x", gpus=4, gpu_class="A100-80GB")
    kept = make_model("kept", gpus_per_node=4, min_replicas=1).profiles.get()
    other = make_model("other", gpus_per_node=2, min_replicas=0, max_replicas=2).profiles.get()
    make_replica(kept, placement=[(a, range(4))], last_used=ago(7200))  # counts, though its min keeps it
    make_replica(other, placement=[(a, [4, 5])], last_used=ago(1800))  # under an hour
    make_replica(other, placement=[(a, [6, 7])], last_used=None)  # unknown is not idle
    held = cluster_summary().as_json()["idle_held_gpus"]
    assert held == {
        "total": 4,
        "by_class": [
            {"gpu_class": "A100-80GB", "gpus": 0},
            {"gpu_class": "H100-80GB", "gpus": 4},
            {"gpu_class": L40S, "gpus": 0},
        ],
    }


def test_without_a_usage_watch_nothing_is_stoppable_and_the_reason_says_so():
    a = make_node("gpu-a", fabric="ib-a")
    profile = make_model("m", gpus_per_node=8, min_replicas=0).profiles.get()
    make_replica(profile, placement=[(a, range(8))], last_used=ago(9000))
    summary = cluster_summary().as_json()
    assert summary["usage"] == {"known": False, "since": None, "reason": "no tick has collected usage yet"}
    assert summary["stoppable"] == []
    assert summary["idle_held_gpus"] == {"total": 0, "by_class": [{"gpu_class": "H100-80GB", "gpus": 0}]}


def test_lapsed_usage_makes_old_stamps_unknown_not_idle():
    a = make_node("gpu-a", fabric="ib-a")
    profile = make_model("m", gpus_per_node=8, min_replicas=0).profiles.get()
    make_replica(profile, placement=[(a, range(8))], last_used=ago(9000))
    watch_usage(known_since=None, reason="router r-2 has not flushed for 45s")
    summary = cluster_summary().as_json()
    assert summary["usage"] == {"known": False, "since": None, "reason": "router r-2 has not flushed for 45s"}
    assert summary["stoppable"] == [] and summary["idle_held_gpus"]["total"] == 0


def test_an_expired_lease_makes_usage_unknown(settings, usage_known):
    now = timezone.now()
    Lease.objects.create(name=settings.LLMGW_LEASE_NAME, owner="cp-1", epoch=3, expires_at=now.timestamp() - 40)
    usage = cluster_summary(now).as_json()["usage"]
    assert usage["known"] is False and usage["reason"].startswith("the leader's lease expired 40s ago")


def test_known_usage_reports_since_when():
    since = ago(300)
    watch_usage(known_since=since)
    assert cluster_summary().as_json()["usage"] == {"known": True, "since": since.isoformat(), "reason": ""}


def _grow(nodes: int):
    """`nodes` nodes, each with an idle 6-GPU replica and a 2-GPU one of unknown use, and one blocked model."""
    six = make_model(f"six-{nodes}", gpus_per_node=6, min_replicas=0, max_replicas=nodes).profiles.get()
    two = make_model(f"two-{nodes}", gpus_per_node=2, min_replicas=0, max_replicas=nodes).profiles.get()
    for i in range(nodes):
        node = make_node(f"n{nodes}-{i}", fabric=f"ib-{i % 3}")
        make_replica(six, placement=[(node, range(6))], last_used=ago(600 + i))
        make_replica(two, placement=[(node, [6, 7])], last_used=None if i % 2 else ago(5000))
    pending(make_model(f"big-{nodes}", gpus_per_node=6, min_replicas=0), "needs 6×H100-80GB on one node")


def test_what_can_i_stop_runs_the_same_number_of_queries_for_2_and_20_nodes(usage_known, django_assert_num_queries):
    # 11 for the summary, then usage watch, occupants (3), spare replicas (2), sleepers (1), profiles (1): the free
    # GPUs are the summary's own read.
    _grow(2)
    with django_assert_num_queries(19):
        small = cluster_summary().as_json()
    _grow(20)
    with django_assert_num_queries(19):
        large = cluster_summary().as_json()
    assert len(small["stoppable"]) == 3 and len(large["stoppable"]) == 3 + 30
    assert {e["model"]: e["unblocks"] for e in large["stoppable"]}["six-20"] == ["big-2", "big-20"]
