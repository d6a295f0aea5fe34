"""Prefetch: a profile keeps its weights staged on `prefetch_nodes` nodes of its class, ahead of any replica."""

from datetime import timedelta

import pytest
from django.utils import timezone

from inventory.models import Weights, WeightsStage
from reconciler.models import PendingCommand, Replica
from reconciler.tests.weights.test_staging import report, serving_node
from tests.fleet import make_model

pytestmark = pytest.mark.django_db


def test_a_profile_keeps_its_weights_on_as_many_nodes_as_it_asks_copied_from_the_holder(run_tick, agent_inbox, leader):
    holder = serving_node("gpu-1")
    serving_node("gpu-2"), serving_node("gpu-3"), serving_node("gpu-4")
    Weights.objects.create(node=holder, source="org/warm", path="/w/hub/models--org--warm", size_bytes=1,
                           seen_at=timezone.now())  # fmt: skip
    inboxes = {n: agent_inbox(n) for n in ("gpu-2", "gpu-3", "gpu-4")}
    make_model("warm", engine="vllm", min_replicas=0, prefetch_nodes=3)
    now = timezone.now()
    leader.next_stall_check = now - timedelta(seconds=1)
    run_tick(now=now)
    asked = {n: [c for c in inbox() if c["type"] == "stage_weights"] for n, inbox in inboxes.items()}
    assert {n: len(cs) for n, cs in asked.items()} == {"gpu-2": 1, "gpu-3": 1, "gpu-4": 0}  # 3 wanted, 1 held
    assert [p["node"] for p in asked["gpu-2"][0]["peers"]] == ["gpu-1"]
    # The holder first, then the node fetching them too (followed file by file).
    assert [p["node"] for p in asked["gpu-3"][0]["peers"]] == ["gpu-1", "gpu-2"]
    assert not Replica.objects.exists()  # no replica is started for it

    # One failed: it is not asked again within the hour; the others stay counted.
    PendingCommand.objects.all().delete()  # acknowledged
    report(WeightsStage.objects.get(node__name="gpu-2").node, "org/warm", "failed", message="disk full")
    leader.next_stall_check = now
    run_tick(now=now + timedelta(seconds=1))
    assert [c["type"] for c in inboxes["gpu-2"]()] == []
    assert [c["source"] for c in inboxes["gpu-4"]() if c["type"] == "stage_weights"] == ["org/warm"]
