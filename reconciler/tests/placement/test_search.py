"""Unit tests of reconciler.placement.search: pure functions, no database."""

import pytest

from reconciler.placement.search import NodeCapacity, Placement, Shape, Unplaceable, pick_port, place

H100 = "H100-80GB"


def node(name, free, total=8, fabric="", gpu_class=H100):
    return NodeCapacity(name, fabric, f"10.0.0.{len(name)}", gpu_class, tuple(free), total)


def test_single_node_best_fit_takes_the_node_with_fewest_free_gpus_that_still_fits():
    result = place([node("gpu-a", range(8)), node("gpu-b", [1, 3, 5]), node("gpu-c", [0])], Shape(H100, 2))
    assert result == Placement((node_shard("gpu-b", (1, 3)),))


def node_shard(name, indices):
    from reconciler.placement.search import ShardPlacement

    return ShardPlacement(name, f"10.0.0.{len(name)}", indices)


def test_single_node_tie_on_free_count_goes_to_the_first_name():
    result = place([node("gpu-b", [0, 1]), node("gpu-a", [6, 7])], Shape(H100, 2))
    assert result.shards[0].node == "gpu-a"
    assert result.shards[0].gpu_indices == (6, 7)


def test_single_node_explains_the_most_free_on_one_node():
    result = place([node("gpu-a", [0, 1]), node("gpu-b", [4])], Shape(H100, 4))
    assert result == Unplaceable("needs 4×H100-80GB on one node; most free on one node: 2 (gpu-a)")


def test_gpus_out_of_service_are_named_where_a_replica_does_not_fit():
    sick = NodeCapacity("gpu-b", "", "10.0.0.5", H100, (), 8, out_of_service=8)
    result = place([node("gpu-a", [0]), sick], Shape(H100, 2))
    assert result == Unplaceable(
        "needs 2×H100-80GB on one node; most free on one node: 1 (gpu-a); unhealthy or in quarantine: 8 on gpu-b"
    )
    whole = [NodeCapacity(f"n{i}", "ib", "a", H100, (), 8, out_of_service=1 + i) for i in range(5)]
    assert place(whole, Shape(H100, 8, 2)).reason == (
        "needs 2 whole H100-80GB nodes on one fabric; free: none; "
        "unhealthy or in quarantine: 1 on n0, 2 on n1, 3 on n2 and 2 more nodes"
    )


def test_wrong_gpu_class_is_not_capacity():
    result = place([node("gpu-a", range(8))], Shape("L4-24GB", 1))
    assert result == Unplaceable("no node has GPU class L4-24GB")


def test_multi_node_takes_whole_nodes_on_one_fabric_by_name():
    capacity = [
        node("gpu-d", range(8), fabric="ib-a"),
        node("gpu-c", range(8), fabric="ib-a"),
        node("gpu-b", range(8), fabric="ib-a"),
    ]
    result = place(capacity, Shape(H100, 8, 2))
    assert [s.node for s in result.shards] == ["gpu-b", "gpu-c"]
    assert all(s.gpu_indices == tuple(range(8)) for s in result.shards)


def test_multi_node_picks_the_fabric_with_fewest_whole_free_nodes_that_fits():
    capacity = [node(f"a{i}", range(8), fabric="ib-a") for i in range(3)] + [
        node(f"b{i}", range(8), fabric="ib-b") for i in range(2)
    ]
    result = place(capacity, Shape(H100, 8, 2))
    assert [s.node for s in result.shards] == ["b0", "b1"]


def test_multi_node_refuses_whole_nodes_split_across_fabrics_with_the_aggregate_reason():
    capacity = [node("gpu-a", range(8), fabric="ib-a"), node("gpu-b", range(8), fabric="ib-b")]
    result = place(capacity, Shape(H100, 8, 2))
    assert result == Unplaceable("needs 2 whole H100-80GB nodes on one fabric; free: 1 on ib-a, 1 on ib-b")


def test_multi_node_never_combines_nodes_without_a_fabric():
    capacity = [node("gpu-a", range(8)), node("gpu-b", range(8))]
    result = place(capacity, Shape(H100, 8, 2))
    assert result == Unplaceable("needs 2 whole H100-80GB nodes on one fabric; free: 2 without a fabric")


def test_multi_node_needs_whole_nodes_not_just_enough_free_gpus():
    # 7 of 8 free is enough GPUs for gpus_per_node=4 but not a whole node.
    capacity = [node("gpu-a", range(8), fabric="ib-a"), node("gpu-b", range(1, 8), fabric="ib-a")]
    result = place(capacity, Shape(H100, 4, 2))
    assert result == Unplaceable("needs 2 whole H100-80GB nodes on one fabric; free: 1 on ib-a")


def test_gpus_the_caller_left_out_of_free_are_not_used():
    # Unhealthy and quarantined GPUs are absent from `free` but count in `total`.
    result = place([node("gpu-a", [0, 1, 2], total=4)], Shape(H100, 4))
    assert result == Unplaceable("needs 4×H100-80GB on one node; most free on one node: 3 (gpu-a)")


def test_no_free_gpu_anywhere_says_zero():
    result = place([node("gpu-a", [], total=8)], Shape(H100, 1))
    assert result == Unplaceable("needs 1×H100-80GB on one node; most free on one node: 0")


def test_bad_shape_and_capacity_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="gpus_per_node"):
        Shape(H100, 0)
    with pytest.raises(ValueError, match="nodes_per_replica"):
        Shape(H100, 1, 0)
    with pytest.raises(ValueError, match="repeat"):
        node("gpu-a", [1, 1])
    with pytest.raises(ValueError, match="only 2 in all"):
        node("gpu-a", [0, 1, 2], total=2)


def test_pick_port_takes_the_lowest_free_port_of_the_inclusive_range():
    assert pick_port(set(), (20000, 20002)) == 20000
    assert pick_port({20000, 20001}, (20000, 20002)) == 20002
    assert pick_port({20000, 20001, 20002}, (20000, 20002)) is None
    with pytest.raises(ValueError, match="port range"):
        pick_port(set(), (30000, 20000))
