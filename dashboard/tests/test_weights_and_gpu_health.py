"""Weights per node, the weights being staged and GPU health reasons on every operator surface: summary, ctl_status,
REST status, metrics and admin."""

from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.urls import reverse
from django.utils import timezone
from prometheus_client import generate_latest
from rest_framework.test import APIClient

from dashboard.metrics import FleetCollector
from dashboard.summary import cluster_summary
from inventory.choices import GPUHealth
from inventory.models import GPU, Weights, WeightsStage
from tests.fleet import make_node

pytestmark = pytest.mark.django_db


# What an agent reports of a GGUF file's headers: its tensors take 3 GiB of the file's 5.
Q4_HEADER = {
    "format": "gguf",
    "tensor_bytes": 3 << 30,
    "parameters": 1,
    "tensors": 1,
    "bytes_by_dtype": {"Q4_K": 3 << 30},
}


@pytest.fixture
def holding():
    a, b = make_node("gpu-a", gpus=2), make_node("gpu-b", gpus=2)
    now = timezone.now()
    Weights.objects.bulk_create(
        [
            Weights(node=a, source="org/small", path="/w/hub/models--org--small", size_bytes=1536, seen_at=now),
            Weights(
                node=a,
                source="gguf/q4.gguf",
                path="/w/gguf/q4.gguf",
                size_bytes=5 * 1024**3,
                seen_at=now,
                header=Q4_HEADER,
            ),
        ]  # fmt: skip
    )
    GPU.objects.filter(node=b, index=1).update(health=GPUHealth.UNHEALTHY, health_reason="XID 79")
    return a, b


def test_the_summary_lists_each_nodes_weights_with_sizes(holding):
    nodes = {n["name"]: n for n in cluster_summary().as_json()["node_list"]}
    assert nodes["gpu-a"]["weights"] == [
        {"source": "gguf/q4.gguf", "size_bytes": 5 * 1024**3, "size": "5.0 GiB"},
        {"source": "org/small", "size_bytes": 1536, "size": "1.5 KiB"},
    ]
    assert nodes["gpu-b"]["weights"] == []


def test_ctl_status_nodes_prints_the_weights_on_disk(holding):
    out = StringIO()
    call_command("ctl_status", "--nodes", stdout=out)
    text = out.getvalue()
    assert "Weights on disk" in text
    rows = [line.split() for line in text.splitlines()[text.splitlines().index("Weights on disk") :]]
    assert ["gpu-a", "gguf/q4.gguf", "5.0", "GiB"] in rows
    assert ["gpu-a", "org/small", "1.5", "KiB"] in rows


def test_rest_status_carries_the_weights_and_gpus_their_health_reason(holding):
    client = APIClient()
    client.force_authenticate(get_user_model().objects.create_user("ops", is_staff=True))
    status = client.get(reverse("api-status")).json()
    assert [w["source"] for w in next(n for n in status["node_list"] if n["name"] == "gpu-a")["weights"]] == [
        "gguf/q4.gguf",
        "org/small",
    ]
    nodes = client.get("/api/v1/nodes/").json()
    rows = nodes["results"] if isinstance(nodes, dict) else nodes
    gpus = next(n for n in rows if n["name"] == "gpu-b")["gpus"]
    assert [(g["index"], g["health"], g["health_reason"]) for g in gpus] == [
        (0, "healthy", ""),
        (1, "unhealthy", "XID 79"),
    ]


def test_node_admin_shows_weights_read_only_with_human_sizes_and_gpu_health_reasons(admin_client, holding):
    a, b = holding
    html = admin_client.get(reverse("admin:inventory_node_change", args=[a.pk])).content.decode()
    assert "Weights on disk" in html
    assert "org/small" in html and "1.5 KiB" in html and "5.0 GiB" in html
    assert "3.0 GiB gguf" in html  # the tensors' bytes as the agent read them from the headers
    assert 'name="weights-0-source"' not in html  # read-only: no input for it
    # When the sweep found them unused: removed once that is a grace period ago.
    assert "Unused since" in html
    html = admin_client.get(reverse("admin:inventory_node_change", args=[b.pk])).content.decode()
    assert "XID 79" in html
    assert "XID 79" in admin_client.get(reverse("admin:inventory_gpu_changelist")).content.decode()


@pytest.fixture
def stages():
    a, b = make_node("gpu-a", gpus=2), make_node("gpu-b", gpus=2)
    now = timezone.now()
    WeightsStage.objects.bulk_create(
        [
            WeightsStage(node=a, source="org/big", state="fetching", bytes_done=820 * 10**6, bytes_total=2 * 10**9,
                         bytes_per_second=50 * 10**6, asked_at=now, updated_at=now),
            WeightsStage(node=b, source="org/big", state="asked", asked_at=now, updated_at=now),
            WeightsStage(node=b, source="org/bad", state="failed", message="model.safetensors did not verify",
                         asked_at=now, updated_at=now, finished_at=now),
            WeightsStage(node=a, source="org/old", state="ready", bytes_done=10, bytes_total=10, asked_at=now,
                         updated_at=now, finished_at=now - timedelta(hours=2)),
        ]
    )  # fmt: skip


def test_stages_under_way_and_just_ended_are_in_the_summary_ctl_status_and_metrics(stages):
    staging = cluster_summary().as_json()["staging"]
    # Under way first, the least done first; then what ended within the hour (the stage ended 2 h ago is left out).
    assert [(s["node"], s["source"], s["state"]) for s in staging] == [
        ("gpu-b", "org/big", "asked"),
        ("gpu-a", "org/big", "fetching"),
        ("gpu-b", "org/bad", "failed"),
    ]
    assert staging[1]["seconds_left"] == pytest.approx(23.6)
    out = StringIO()
    call_command("ctl_status", stdout=out)
    text = out.getvalue()
    assert "Staging weights" in text
    rows = [line.split() for line in text.splitlines()]
    assert ["gpu-a", "org/big", "fetching", "41%", "of", "2.0", "GB", "50.0", "MB/s", "23.6s"] in rows
    assert ["gpu-b", "org/bad", "failed", "model.safetensors", "did", "not", "verify", "-", "-"] in rows
    metrics = generate_latest(FleetCollector()).decode()
    assert 'llmgw_weights_staging_bytes{bytes="done",node="gpu-a",source="org/big"} 8.2e+08' in metrics
    assert 'llmgw_weights_staging_seconds_left{node="gpu-a",source="org/big"} 23.6' in metrics
    assert 'source="org/bad"' not in metrics  # ended: no series


def test_the_admin_lists_the_stages_with_their_progress(admin_client, stages):
    html = admin_client.get(reverse("admin:inventory_weightsstage_changelist")).content.decode()
    assert "org/big" in html and "41% of 1.9 GiB" in html and "47.7 MiB/s" in html and "24 s" in html
    assert "did not verify" in html
    panels = admin_client.get("/admin/").content.decode()
    assert 'id="staging"' in panels and "41% of 2.0 GB" in panels
