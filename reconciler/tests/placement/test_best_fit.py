"""The snapshot's best-fit index chooses, replica after replica, the node `placement.place` would choose."""

from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.placement.capacity import CapacitySnapshot, NodeGPUs
from reconciler.placement.search import Placement, Shape, on_node, place

CLASS = "H100-80GB"

node_free = st.lists(st.sets(st.integers(0, 7)), min_size=1, max_size=12)
holders = st.sets(st.sampled_from([f"n{i:02d}" for i in range(14)]), max_size=4)
asks = st.lists(st.sampled_from([1, 1, 2, 4, 8]), min_size=1, max_size=30)


def snapshot_of(free_sets: list[set[int]]) -> CapacitySnapshot:
    snapshot = CapacitySnapshot()
    # Names out of insertion order, so the index's own order is what is tested.
    for i, free in reversed(list(enumerate(free_sets))):
        name = f"n{i:02d}"
        node = NodeGPUs(i, name, "ib-a", f"10.0.0.{i}", CLASS, total=8, memory_mib=81920)
        node.free = {index: 100 * i + index for index in sorted(free)}
        snapshot.nodes[CLASS][name] = node
    snapshot.index_records()
    return snapshot


@settings(max_examples=300, deadline=None)
@given(node_free, holders, asks)
def test_best_fit_places_every_replica_where_place_would(free_sets, weights_on, needs):
    snapshot = snapshot_of(free_sets)
    for port, need in enumerate(needs, start=20000):
        expected = place(snapshot.records(CLASS), Shape(CLASS, need, 1), weights_on)
        best = snapshot.best_fit(CLASS, need, weights_on)
        if not isinstance(expected, Placement):
            assert best is None
            continue
        assert best is not None and on_node(best, need) == expected
        (shard,) = expected.shards
        snapshot.take(CLASS, shard.node, shard.gpu_indices, port)


def test_an_unknown_class_has_no_best_fit():
    assert snapshot_of([{0, 1}]).best_fit("L40S-48GB", 1, ()) is None
