"""/metrics carries the fleet gauges, with the values of cluster_summary() at scrape time."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dashboard.summary import cluster_summary
from inventory.choices import NodeState
from reconciler.choices import ReplicaState
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


def scrape(client) -> dict:
    response = client.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        if family.name.startswith("llmgw_"):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_metrics_equal_the_cluster_summary(client):
    a = make_node("gpu-a", gpus=4, fabric="ib-a")
    make_node("gpu-b", gpus=4, fabric="ib-b")
    make_node("gpu-c", gpus=4, fabric="ib-b", state=NodeState.UNREACHABLE)
    profile = make_model("llama-70b", gpus_per_node=2, min_replicas=0).profiles.get()
    make_replica(profile, placement=[(a, [0, 1])])
    make_replica(profile, state=ReplicaState.PENDING, error="no room")

    samples = scrape(client)
    summary = cluster_summary().as_json()
    for row in summary["capacity"]:
        for state in ("used", "free", "unhealthy", "unavailable"):
            assert samples[("llmgw_gpus", (("gpu_class", row["gpu_class"]), ("state", state)))] == row[state]
    for row in summary["free_nodes"]:
        key = ("llmgw_whole_free_nodes", (("fabric", row["fabric"]), ("gpu_class", row["gpu_class"])))
        assert samples[key] == row["whole_free_nodes"]
    for state, count in summary["replicas"].items():
        if state != "total":
            assert samples[("llmgw_replicas", (("state", state),))] == count
    for model in summary["models"]:
        for kind in ("wanted", "ready"):
            assert samples[("llmgw_model_replicas", (("kind", kind), ("model", model["name"])))] == model[kind]
    for state, count in summary["nodes"].items():
        if state != "total":
            assert samples[("llmgw_nodes", (("state", state),))] == count
    assert samples[("llmgw_summary_up", ())] == 1
    # Spot-check against the rows themselves, not only the summary.
    assert samples[("llmgw_gpus", (("gpu_class", "H100-80GB"), ("state", "used")))] == 2
    assert samples[("llmgw_whole_free_nodes", (("fabric", "ib-b"), ("gpu_class", "H100-80GB")))] == 1
    assert samples[("llmgw_model_replicas", (("kind", "wanted"), ("model", "llama-70b")))] == 2


def test_metrics_module_registers_its_collector_once():
    from prometheus_client import REGISTRY

    from dashboard import metrics

    assert metrics.register() is metrics.register()
    assert sum(1 for c in REGISTRY._collector_to_names if isinstance(c, metrics.FleetCollector)) == 1


def test_sleeping_replicas_show_their_gpus_host_memory_and_wake_time_per_model(client):
    from catalog.models import Profile
    from reconciler.models import Replica

    a, b = make_node("gpu-a", gpus=4), make_node("gpu-b", gpus=4)
    profile = make_model("sleepy", gpus_per_node=2, min_replicas=0, max_replicas=3).profiles.get()
    level_one, level_two = (
        make_replica(profile, placement=[(a, [0, 1])]),
        make_replica(profile, placement=[(b, [0, 1])]),
    )
    make_replica(profile, placement=[(a, [2, 3])])  # awake: not counted
    for replica, level in ((level_one, 1), (level_two, 2)):
        Replica.objects.filter(pk=replica.pk).update(
            state=ReplicaState.SLEEPING, sleeping_level=level, weights_bytes=5 << 30
        )
    Profile.objects.filter(pk=profile.pk).update(wake_seconds=1.5)

    samples = scrape(client)

    model = (("model", "sleepy"),)
    assert samples[("llmgw_sleeping_gpus", model)] == 4
    assert samples[("llmgw_sleeping_host_memory_bytes", model)] == 5 << 30  # level 2 holds none
    assert samples[("llmgw_model_wake_seconds", model)] == 1.5
