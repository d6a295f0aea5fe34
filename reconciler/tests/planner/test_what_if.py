"""The what-if planner: each verdict, the cumulative rule, the tick's own eviction rules, no writes, fixed queries."""

from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from catalog.models import Model, Profile
from hub import get_hub
from inventory.models import Node
from reconciler.choices import ReplicaState
from reconciler.models import Replica, Shard
from reconciler.placement.fit import MemoryCheck
from reconciler.planner.answer import Problem, Verdict
from reconciler.planner.what_if import PlanInputError, entries_from_data, entries_from_names, plan
from tests.fleet import make_model, make_node, make_replica, watch_usage

pytestmark = pytest.mark.django_db

H100 = "H100-80GB"
L40S = "L40S-48GB"
LLAMA_70B = {"parameters_billions": 70.0, "dtype": "bfloat16", "layers": 80, "kv_heads": 8, "head_dim": 128}


def entry(name, *profiles, **size):
    """A catalog-file entry with `profiles` (dicts of profile fields; gpu_class defaults to H100)."""
    listed = [{"gpu_class": H100, "gpus_per_node": 8, "min_replicas": 0, **p} for p in profiles or [{}]]
    return {"name": name, "source": f"org/{name}", **size, "profiles": listed}


def ask(*entries):
    return plan(entries_from_data({"models": list(entries)}), timezone.now())


def serving(name, node, *, idle=600, ready=3600, priority=0, min_replicas=0, indices=range(8), gpus_per_node=8):
    """A READY replica of a new model on `node`, idle for `idle` s (None: unknown), ready for `ready` s."""
    model = make_model(
        name, gpus_per_node=gpus_per_node, min_replicas=min_replicas, priority=priority, idle_timeout_seconds=0
    )
    now = timezone.now()
    replica = make_replica(
        model.profiles.get(),
        placement=[(node, list(indices))],
        last_used=None if idle is None else now - timedelta(seconds=idle),
    )
    Replica.objects.filter(pk=replica.pk).update(ready_at=now - timedelta(seconds=ready))
    return replica


def test_a_model_that_fits_says_where_best_fit_first():
    make_node("roomy", gpus=8)
    tight = make_node("tight", gpus=8)
    serving("other", tight, indices=range(6), gpus_per_node=6)

    answer = ask(entry("small", {"gpus_per_node": 2})).models[0]

    assert (answer.verdict, answer.profile, answer.stop) == (Verdict.FITS, 0, [])
    assert [(s.node, s.gpus) for s in answer.where] == [("tight", [6, 7])]


def test_the_first_profile_with_room_wins_and_the_one_before_says_why_not():
    make_node("l40s", gpus=4, gpu_class=L40S)
    make_node("h100", gpus=2)
    answer = ask(
        entry(
            "llama-70b",
            {"gpu_class": L40S, "gpus_per_node": 2, "max_model_len": 8192},
            {"gpu_class": H100, "gpus_per_node": 2, "max_model_len": 8192},
            **LLAMA_70B,
        )
    ).models[0]

    assert (answer.verdict, answer.profile) == (Verdict.FITS, 1)
    first = answer.profiles[0]
    assert (first.verdict, first.problem) == (Verdict.DOES_NOT_FIT, Problem.MEMORY)
    assert first.reason.startswith("needs 68.9 GiB per GPU; L40S-48GB has 44.2 GiB usable")
    assert answer.size_known and answer.needs_gib_per_gpu == 68.9
    assert answer.usable_gib_per_gpu == 73.6 and answer.full_length_sequences >= 1


def test_a_class_whose_nodes_are_all_out_of_service_is_named_as_the_tick_names_it():
    make_node("a", gpus=4, fabric="ib-a")
    Node.objects.filter(name="a").update(schedulable=False)

    answer = ask(entry("big", {"gpus_per_node": 1})).models[0]

    assert answer.profiles[0].reason == "every node with GPU class H100-80GB is out of service (cordoned: a)"


@pytest.mark.parametrize(
    ("profile", "problem", "reason"),
    [
        ({"gpu_class": "A100-40GB"}, Problem.GPU_COUNT, "no node has GPU class A100-40GB"),
        ({"gpus_per_node": 8}, Problem.GPU_COUNT, "needs 8 H100-80GB GPUs on one node; the most on one node: 4"),
        (
            {"gpus_per_node": 4, "nodes_per_replica": 2},
            Problem.FABRIC,
            "needs 2 H100-80GB nodes of 4+ GPUs on one fabric; there are 1 on ib-a, 1 on ib-b",
        ),
    ],
)
def test_does_not_fit_names_the_gpu_count_or_the_fabric(profile, problem, reason):
    make_node("a", gpus=4, fabric="ib-a")
    make_node("b", gpus=4, fabric="ib-b")

    answer = ask(entry("big", profile)).models[0]

    assert (answer.verdict, answer.profile, answer.where) == (Verdict.DOES_NOT_FIT, None, [])
    assert (answer.profiles[0].problem, answer.profiles[0].reason) == (problem, reason)
    assert answer.reason.startswith(f"profiles[0] {answer.profiles[0].shape}: {reason}")


def test_a_model_whose_size_is_unknown_is_judged_by_gpu_count_and_says_so():
    make_node("a", gpus=8)

    answer = ask(entry("mystery", {"gpus_per_node": 4})).models[0]

    assert answer.verdict == Verdict.FITS
    assert (answer.size_known, answer.needs_gib_per_gpu) == (False, None)
    assert answer.reason.startswith("judged by GPU count alone: size unknown")


@pytest.mark.usefixtures("usage_known")
def test_fits_after_stopping_the_least_recently_used_with_what_each_frees():
    a, b = make_node("gpu-a", fabric="ib-a"), make_node("gpu-b", fabric="ib-a")
    serving("recent", a, idle=300)
    stale = serving("stale", b, idle=3000)

    answer = ask(entry("newcomer")).models[0]

    assert (answer.verdict, answer.profile) == (Verdict.FITS_AFTER_STOPPING, 0)
    assert [(s.replica, s.model) for s in answer.stop] == [(stale.pk, "stale")]
    assert answer.stop[0].frees == "8 H100-80GB GPUs on gpu-b (the whole node, fabric ib-a)"
    assert [s.node for s in answer.where] == ["gpu-b"]


@pytest.mark.usefixtures("usage_known")
def test_models_are_planned_cumulatively_taking_gpus_and_victims_in_order():
    a, b = make_node("gpu-a"), make_node("gpu-b")
    make_node("gpu-c")
    recent = serving("recent", a, idle=300)
    stale = serving("stale", b, idle=3000)

    first, second, third, fourth = ask(entry("one"), entry("two"), entry("three"), entry("four")).models

    assert (first.verdict, [s.node for s in first.where]) == (Verdict.FITS, ["gpu-c"])
    # gpu-c is taken by the first: the second stops the least recently used, the third the other one.
    assert (second.verdict, [s.replica for s in second.stop]) == (Verdict.FITS_AFTER_STOPPING, [stale.pk])
    assert (third.verdict, [s.replica for s in third.stop]) == (Verdict.FITS_AFTER_STOPPING, [recent.pk])
    assert fourth.verdict == Verdict.DOES_NOT_FIT
    assert fourth.profiles[0].problem == Problem.ROOM
    assert "stopping what may be stopped would not make room (0 replicas may be stopped)" in fourth.reason


def test_nothing_is_offered_for_stopping_while_usage_is_unknown():
    watch_usage(known_since=None, reason="a router's mark lapsed")
    serving("stale", make_node("gpu-a"), idle=3000)

    result = ask(entry("newcomer"))

    assert result.models[0].verdict == Verdict.DOES_NOT_FIT
    assert (result.usage_known, result.usage_reason) == (False, "a router's mark lapsed")
    assert "usage is unknown" in result.models[0].reason


def tick_stops(run_tick, name):
    """Ask the tick for `name` (made in the catalog) and return the replicas it put to stopping."""
    make_model(name, gpus_per_node=8, min_replicas=0)
    async_to_sync(get_hub().request_activation)(name)
    run_tick()
    return set(Replica.objects.filter(state=ReplicaState.STOPPING).values_list("pk", flat=True))


@pytest.mark.usefixtures("usage_known")
@pytest.mark.parametrize(
    "guarded",
    [
        {"priority": 10},  # higher priority than the waiting model
        {"idle": None},  # last use unknown
        {"idle": 30},  # used too recently
        {"ready": 60},  # too young
        {"min_replicas": 1},  # its model would go below min replicas
        {"busy": True},  # its engine reports a request running
        {"own": True},  # the planned model's own replica
    ],
)
def test_the_planner_offers_exactly_the_replica_the_tick_stops(guarded, run_tick):
    a, b = make_node("gpu-a", fabric="ib-a"), make_node("gpu-b", fabric="ib-a")
    name = "newcomer"
    # The guarded one is the least recently used, so only a guard keeps it.
    kept = serving(
        name if guarded.get("own") else "guarded",
        a,
        **{"idle": 5000, **{k: v for k, v in guarded.items() if k not in ("busy", "own")}},
    )
    if guarded.get("busy"):
        Shard.objects.filter(replica=kept).update(running=1)
    other = serving("other", b, idle=300)
    if guarded.get("own"):
        Profile.objects.filter(model__name=name).update(max_replicas=2)
        entries = entries_from_names([name])
    else:
        entries = entries_from_data({"models": [entry(name)]})

    offered = {s.replica for s in plan(entries, timezone.now()).models[0].stop}
    if guarded.get("own"):
        async_to_sync(get_hub().request_activation)(name)
        Profile.objects.filter(model__name=name).update(min_replicas=2)
        run_tick()
        stopped = set(Replica.objects.filter(state=ReplicaState.STOPPING).values_list("pk", flat=True))
    else:
        stopped = tick_stops(run_tick, name)

    assert offered == stopped == {other.pk}


def test_planning_writes_nothing_and_reads_a_fixed_number_of_queries(usage_known):
    def fleet(size):
        for i in range(size):
            node = make_node(f"n{size}-{i}", fabric="ib-a")
            serving(f"m{size}-{i}", node, idle=3000)

    counts = []
    for size in (1, 6):
        fleet(size)
        entries = entries_from_data({"models": [entry("x"), entry("y", {"gpus_per_node": 1}), entry("z")]})
        with CaptureQueriesContext(connection) as queries:
            answers = plan(entries, timezone.now()).models
        assert [a.verdict for a in answers][0] == Verdict.FITS_AFTER_STOPPING
        assert all(q["sql"].lstrip().upper().startswith("SELECT") for q in queries.captured_queries)
        counts.append(len(queries))
    # usage, free capacity (3), weights, occupants (3), spare replicas (2), sleep levels
    assert counts == [11, 11]


def test_catalog_models_are_planned_by_name_or_alias_in_three_queries():
    make_node("a", gpus=8)
    model = make_model("llama", gpus_per_node=4)
    model.aliases.create(name="llama-latest")

    with CaptureQueriesContext(connection) as queries:
        entries = entries_from_names(["llama-latest", "llama"])
    assert len(queries) == 3
    assert [e.name for e in entries] == ["llama", "llama"]
    assert [[p.pk for p in e.profiles] for e in entries] == [[model.profiles.get().pk]] * 2


def test_unknown_names_and_bad_entries_are_named():
    Model.objects.create(name="known", source="org/known")
    with pytest.raises(PlanInputError) as unknown:
        entries_from_names(["known", "nope", "gone"])
    assert unknown.value.messages == [
        "no catalog model or alias named 'nope'",
        "no catalog model or alias named 'gone'",
    ]

    with pytest.raises(PlanInputError) as bad:
        entries_from_data({"models": [{"name": "x", "source": "org/x", "profiles": [{"gpus_per_node": 0}]}]})
    assert any("gpus_per_node" in m for m in bad.value.messages)
    assert any("gpu_class: missing" in m for m in bad.value.messages)


def test_the_memory_check_tells_unsaved_profiles_apart():
    small = Model(name="small", source="org/small", parameters_billions=7.0, dtype="bfloat16")
    large = Model(name="large", source="org/large", **LLAMA_70B)
    check = MemoryCheck()

    needs = [check.verdict(Profile(model=m, gpu_class=H100, gpus_per_node=1), 81920).needs_gib for m in (small, large)]

    assert needs[0] < 20 < 100 < needs[1]


def test_where_it_fits_is_where_the_tick_places_it(run_tick):
    # One class, two memory sizes: the small node fits best by GPU count but cannot hold the model.
    make_node("small", gpus=2, gpu_class="A100", memory_mb=40 * 1024)
    make_node("large", gpus=4, gpu_class="A100", memory_mb=80 * 1024)
    make_node("larger", gpus=8, gpu_class="A100", memory_mb=80 * 1024)
    model = make_model("llama-70b", gpu_class="A100", gpus_per_node=2, max_model_len=8192)
    Model.objects.filter(pk=model.pk).update(**LLAMA_70B)

    answer = plan(entries_from_names(["llama-70b"]), timezone.now()).models[0]
    run_tick()

    shard = Shard.objects.get(replica__model=model)
    assert answer.verdict == Verdict.FITS
    assert [(s.node, s.gpus) for s in answer.where] == [
        (shard.node.name, sorted(shard.gpu_assignments.values_list("gpu__index", flat=True)))
    ]
    assert shard.node.name == "large"


def test_a_catalog_profile_at_its_own_max_is_not_offered_the_next_one_is():
    a = make_node("gpu-a", gpus=8)
    model = make_model("llama", gpus_per_node=2, max_replicas=1)
    Profile.objects.create(model=model, order=1, gpu_class=H100, gpus_per_node=4, max_replicas=1)
    make_replica(model.profiles.get(order=0), placement=[(a, [0, 1])])

    with CaptureQueriesContext(connection) as queries:
        answer = plan(entries_from_names(["llama"]), timezone.now()).models[0]

    assert (answer.verdict, answer.profile, [s.gpus for s in answer.where]) == (Verdict.FITS, 1, [[2, 3, 4, 5]])
    first = answer.profiles[0]
    assert (first.problem, first.reason) == (
        Problem.MAX_REPLICAS,
        "at its max of 1 replica(s): the tick places no more on it",
    )
    assert len(queries) == 3 + 6  # names (3), then usage, free capacity (3), weights, replicas per profile


@pytest.mark.usefixtures("usage_known")
@pytest.mark.parametrize(("busy", "after", "said"), [(False, 30.0, ", in 30 s"), (True, None, ", once its requests")])
def test_a_model_the_tick_would_hold_for_fits_after_stopping_a_replica_not_yet_evictable(
    settings, run_tick, busy, after, said
):
    settings.LLMGW_EVICT_MIN_IDLE_SECONDS, settings.LLMGW_MIN_RESIDENCY_SECONDS = 60, 300
    recent = serving("recent", make_node("gpu-a"), idle=30)  # evictable in 30 s (when not busy)
    if busy:
        Shard.objects.filter(replica=recent).update(running=1)

    answer = ask(entry("newcomer")).models[0]

    assert answer.verdict == Verdict.FITS_AFTER_STOPPING
    (stop,) = answer.stop
    assert stop.replica == recent.pk
    assert stop.after_seconds is None if busy else stop.after_seconds == pytest.approx(after, abs=1)
    assert said in "\n".join(answer.lines())
    # As the tick does: it holds the newcomer's requests (nothing stopped yet, not refused).
    assert tick_stops(run_tick, "newcomer") == set()
    held = Replica.objects.get(model__name="newcomer")
    assert held.state == ReplicaState.PENDING and held.hold == "making_room", held.placement_note
