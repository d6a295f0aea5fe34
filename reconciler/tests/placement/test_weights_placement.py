"""Placement prefers nodes holding the weights: weights first, best fit second."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from catalog.models import Model, Profile
from inventory.models import Weights
from reconciler.models import Shard
from reconciler.placement.search import NodeCapacity, Shape, place
from tests.fleet import H100, make_model, make_node

pytestmark = pytest.mark.django_db


def cap(name, free, total=8, fabric=""):
    return NodeCapacity(name, fabric, f"10.0.0.{name[-1]}", H100, tuple(free), total)


def test_of_two_equal_nodes_the_one_holding_the_weights_is_chosen():
    nodes = [cap("gpu-a", range(4)), cap("gpu-b", range(4))]
    assert place(nodes, Shape(H100, 2)).shards[0].node == "gpu-a"  # without weights: the first name
    assert place(nodes, Shape(H100, 2), holding={"gpu-b"}).shards[0].node == "gpu-b"


def test_a_node_holding_the_weights_wins_over_a_better_fit_without_them():
    snug, roomy = cap("gpu-a", [0, 1]), cap("gpu-b", range(8))
    assert place([snug, roomy], Shape(H100, 2)).shards[0].node == "gpu-a"  # best fit
    assert place([snug, roomy], Shape(H100, 2), holding={"gpu-b"}).shards[0].node == "gpu-b"  # weights first


def test_best_fit_still_decides_among_the_holders_and_a_holder_without_room_is_passed_over():
    nodes = [cap("gpu-a", range(8)), cap("gpu-b", [0, 1, 2]), cap("gpu-c", [5])]
    assert place(nodes, Shape(H100, 2), holding={"gpu-a", "gpu-b", "gpu-c"}).shards[0].node == "gpu-b"
    assert place(nodes, Shape(H100, 2), holding={"gpu-c"}).shards[0].node == "gpu-b"


def test_multi_node_prefers_the_fabric_and_the_nodes_holding_the_weights():
    nodes = [
        cap("gpu-a", range(8), fabric="ib-a"),
        cap("gpu-b", range(8), fabric="ib-a"),
        cap("gpu-c", range(8), fabric="ib-b"),
        cap("gpu-d", range(8), fabric="ib-b"),
        cap("gpu-e", range(8), fabric="ib-b"),
    ]
    shape = Shape(H100, 8, nodes_per_replica=2)
    assert [s.node for s in place(nodes, shape).shards] == ["gpu-a", "gpu-b"]  # the fewest whole free nodes
    assert [s.node for s in place(nodes, shape, holding={"gpu-e"}).shards] == ["gpu-e", "gpu-c"]


def hold(node, source, path=None):
    Weights.objects.create(
        node=node, source=source, path=path or f"/w/hub/{source}", size_bytes=1, seen_at=timezone.now()
    )


def test_the_tick_places_a_replica_on_the_node_holding_its_weights(run_tick):
    snug, roomy = make_node("gpu-a", gpus=2), make_node("gpu-b", gpus=8)
    hold(roomy, "org/llama")
    hold(snug, "org/other")
    make_model("llama", gpus_per_node=2)
    run_tick()
    assert Shard.objects.get().node == roomy


def test_an_absolute_gguf_source_matches_the_path_a_node_reports(run_tick):
    make_node("gpu-a", gpus=2)
    holder = make_node("gpu-b", gpus=8)
    hold(holder, "gguf/q4.gguf", path="/w/gguf/q4.gguf")
    model = Model.objects.create(name="tiny", source="/w/gguf/q4.gguf")
    Profile.objects.create(model=model, engine="llamacpp", gpu_class=H100, gpus_per_node=2, min_replicas=1)
    run_tick()
    assert Shard.objects.get().node == holder


def test_placing_reads_the_weights_in_one_query_however_many_models_and_holders(run_tick):
    def placing_queries(models):
        for i in range(models):
            model = make_model(f"m{models}-{i}")
            for node in nodes:
                hold(node, model.source)
        with CaptureQueriesContext(connection) as queries:
            run_tick()
        return [q["sql"] for q in queries.captured_queries if 'FROM "inventory_weights"' in q["sql"]]

    nodes = [make_node(f"gpu-{i}", gpus=8) for i in range(4)]
    assert len(placing_queries(1)) == 1
    assert len(placing_queries(6)) == 1
