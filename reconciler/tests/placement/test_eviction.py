"""The one eviction order and the fewest victims, on plain data (reconciler.placement.eviction)."""

from reconciler.placement.eviction import Occupant, in_use_no_reason, plan_eviction, stop_candidates
from reconciler.placement.search import NodeCapacity, Placement, Shape

H100 = "H100-80GB"


def holding(rid, model, *, node="gpu-a", gpus=(0, 1, 2, 3), idle=600.0, ready=3600.0, priority=0, running=None):
    nodes = node if isinstance(node, dict) else {node: tuple(gpus)}
    return Occupant(rid, model, priority, idle, ready, H100, nodes, running)


def node(name, free=(), total=8, fabric="ib-a"):
    return NodeCapacity(name, fabric, "10.0.0.1", H100, tuple(free), total)


def candidates(occupants, spare=None, **rules):
    spare = spare if spare is not None else {h.model: 9 for h in occupants}
    rules = {"min_idle": 60, "min_residency": 300, **rules}
    return stop_candidates(occupants, spare, **rules)


def test_candidates_are_lowest_priority_first_then_least_recently_used():
    recent, stale, low = holding(1, "a", idle=100), holding(2, "b", idle=5000), holding(3, "c", idle=70, priority=-5)
    assert [h.replica_id for h in candidates([recent, stale, low])] == [3, 2, 1]


def test_past_the_bound_in_use_is_no_reason_but_unknown_young_important_and_needed_still_are():
    in_use = [holding(1, "just-used", idle=30), holding(2, "busy", running=2), holding(3, "both", idle=1, running=1)]
    kept = [
        holding(4, "unknown", idle=None),
        holding(5, "too-young", idle=1, ready=120),
        holding(6, "important", idle=1, priority=10),
        holding(7, "needed", idle=1),
    ]
    spare = {h.model: 1 for h in in_use + kept} | {"needed": 0}
    overdue = in_use_no_reason([*in_use, *kept], 60)
    # Still in eviction order: one used lately counts as idle the minimum, so the busy one idle longest goes first.
    assert [h.replica_id for h in candidates(overdue, spare, max_priority=0)] == [2, 1, 3]
    assert [h.replica_id for h in candidates([*in_use, *kept], spare, max_priority=0)] == []


def test_unknown_idle_young_busy_and_higher_priority_replicas_are_never_candidates():
    kept = [
        holding(1, "unknown", idle=None),
        holding(2, "just-used", idle=30),
        holding(3, "too-young", ready=120),
        holding(4, "busy", running=2),
        holding(5, "important", priority=10),
    ]
    ok = holding(6, "ok")
    assert [h.replica_id for h in candidates([*kept, ok], max_priority=0)] == [6]


def test_a_model_never_goes_below_its_min_replicas():
    first, second = holding(1, "a", idle=900), holding(2, "a", idle=800)
    assert [h.replica_id for h in candidates([first, second], spare={"a": 1})] == [1]
    assert candidates([first, second], spare={"a": 0}) == []


def test_the_fewest_victims_that_make_room_win_over_an_older_pair():
    # gpu-a holds two 4-GPU replicas idle for ages; gpu-b one 8-GPU replica used more recently.
    old_a, old_b = holding(1, "x", idle=9000), holding(2, "y", idle=8000, gpus=(4, 5, 6, 7))
    whole = holding(3, "z", node="gpu-b", gpus=range(8), idle=700)
    capacity = [node("gpu-a"), node("gpu-b")]
    victims, placement = plan_eviction(capacity, Shape(H100, 8), candidates([old_a, old_b, whole]))
    assert [v.replica_id for v in victims] == [3]
    assert placement.shards[0].node == "gpu-b"


def test_among_equal_choices_the_least_recently_used_goes():
    a = holding(1, "a", node="gpu-a", gpus=range(8), idle=600)
    b = holding(2, "b", node="gpu-b", gpus=range(8), idle=1200)
    victims, placement = plan_eviction([node("gpu-a"), node("gpu-b")], Shape(H100, 8), candidates([a, b]))
    assert [v.replica_id for v in victims] == [2] and placement.shards[0].node == "gpu-b"


def test_free_gpus_count_so_one_small_victim_can_be_enough():
    small = holding(1, "a", gpus=(0, 1))
    victims, placement = plan_eviction([node("gpu-a", free=range(2, 8))], Shape(H100, 8), candidates([small]))
    assert [v.replica_id for v in victims] == [1]
    assert isinstance(placement, Placement)


def test_no_plan_when_what_may_be_stopped_does_not_free_enough():
    small = holding(1, "a", gpus=(0, 1))  # the other 6 GPUs are held by something that may not be stopped
    assert plan_eviction([node("gpu-a")], Shape(H100, 8), candidates([small])) is None


def test_multi_node_needs_whole_nodes_on_one_fabric_and_counts_a_spanning_victim_once():
    spanning = holding(1, "big", node={"gpu-a": tuple(range(8)), "gpu-b": tuple(range(8))}, idle=900)
    lone = holding(2, "other", node="gpu-c", gpus=range(8), idle=5000)
    capacity = [node("gpu-a"), node("gpu-b"), node("gpu-c", fabric="ib-b")]
    victims, placement = plan_eviction(capacity, Shape(H100, 8, nodes_per_replica=2), candidates([spanning, lone]))
    assert [v.replica_id for v in victims] == [1]
    assert {s.node for s in placement.shards} == {"gpu-a", "gpu-b"}


def test_multi_node_skips_a_node_that_holds_a_replica_that_may_not_be_stopped():
    stoppable = holding(1, "a", node="gpu-a", gpus=range(8))
    # gpu-b is half held by something not stoppable: it can never be whole.
    capacity = [node("gpu-a"), node("gpu-b", free=range(4))]
    assert plan_eviction(capacity, Shape(H100, 8, nodes_per_replica=2), candidates([stoppable])) is None
