"""Placement sizes hub models by the headers agents report, read with the weights on disk: no query of its own."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from catalog.models import Model, Profile
from inventory.services import record_weights
from inventory.tests.test_reported_sizes import LLAMA_70B, report
from reconciler.choices import ReplicaState
from reconciler.models import Replica, Shard
from tests.fleet import make_model, make_node

pytestmark = pytest.mark.django_db

L40S = "L40S-48GB"
H100 = "H100-80GB"


def reported_70b(names: list[str], *nodes) -> list[Model]:
    """Hub models on L40S×2 then H100×2, whose catalog fields say 7 B while the nodes' headers say 70 B."""
    models = []
    for name in names:
        model = make_model(name, gpu_class=L40S, gpus_per_node=2, max_model_len=8192)
        Model.objects.filter(pk=model.pk).update(parameters_billions=7.0, dtype="bfloat16")
        Profile.objects.create(model=model, order=1, gpu_class=H100, gpus_per_node=2, max_model_len=8192)
        models.append(model)
    every = [report(m.source, LLAMA_70B) for m in Model.objects.all()]
    for node in nodes:
        record_weights(node.pk, every, timezone.now())  # a node reports all it holds at once
    return models


def test_placement_refuses_what_the_reported_headers_say_cannot_fit_and_names_the_source(run_tick):
    l40s = make_node("l40s-a", gpus=4, gpu_class=L40S)
    (model,) = reported_70b(["llama-70b"], l40s)

    run_tick()

    replica = Replica.objects.get(model=model)
    assert replica.state == ReplicaState.PENDING  # no H100 node: the L40S profile was refused by its size
    assert "L40S-48GB×2: needs 69.5 GiB per GPU; L40S-48GB has 44.2 GiB usable" in replica.placement_note
    assert "size from safetensors headers as node l40s-a reports them" in replica.placement_note
    assert not Shard.objects.exists()


def test_the_next_profile_takes_it_where_the_reported_size_fits(run_tick):
    l40s = make_node("l40s-a", gpus=4, gpu_class=L40S)
    make_node("h100-a", gpus=2, gpu_class=H100)
    (model,) = reported_70b(["llama-70b"], l40s)

    run_tick()

    replica = Replica.objects.get(model=model)
    assert replica.state == ReplicaState.STARTING and replica.profile.gpu_class == H100


def test_the_tick_reads_the_reports_in_the_one_weights_query_however_many_models(run_tick):
    nodes = [make_node(f"l40s-{i}", gpus=8, gpu_class=L40S) for i in range(3)]

    def weights_queries(count: int) -> list[str]:
        reported_70b([f"m{count}-{i}" for i in range(count)], *nodes)
        with CaptureQueriesContext(connection) as queries:
            run_tick()
        return [q["sql"] for q in queries.captured_queries if 'FROM "inventory_weights"' in q["sql"]]

    assert len(weights_queries(1)) == 1
    assert len(weights_queries(6)) == 1
    # Every one of them was judged by its reported size (70 B), not its catalog fields (7 B, which fit).
    assert Replica.objects.filter(state=ReplicaState.PENDING).count() == 7
    assert not Shard.objects.exists()


def test_the_planner_sizes_hub_models_by_the_reported_headers_too():
    from reconciler.planner.what_if import plan_request

    l40s = make_node("l40s-a", gpus=4, gpu_class=L40S)
    make_node("h100-a", gpus=2, gpu_class=H100)
    reported_70b(["llama-70b"], l40s)

    (answer,) = plan_request(names=["llama-70b"]).models

    assert (answer.verdict, answer.profile) == ("fits", 1)  # the L40S profile is refused by the reported 70 B
    assert answer.needs_gib_per_gpu == 69.5  # the catalog fields (7 B) would say about 9
