""" "What can I stop" on the other surfaces: the /admin panel, /api/v1/status and the fleet metrics."""

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from dashboard.summary import cluster_summary
from dashboard.tests.test_metrics import scrape
from reconciler.choices import ReplicaState
from tests.fleet import make_model, make_node, make_replica, watch_usage

pytestmark = pytest.mark.django_db

L40S = "L40S-48GB"


def ago(seconds):
    return timezone.now() - timedelta(seconds=seconds)


def idle_fleet(replicas=1):
    """`replicas` idle 8-GPU replicas, each on its own ib-a node, plus an idle-free L40S node and a blocked model."""
    make_node("gpu-l", gpus=2, gpu_class=L40S)
    profile = make_model("llama-70b", gpus_per_node=8, min_replicas=0, max_replicas=replicas).profiles.get()
    made = []
    for i in range(replicas):
        node = make_node(f"gpu-{i:03d}", fabric="ib-a")
        made.append(make_replica(profile, placement=[(node, range(8))], last_used=ago(7200 + i)))
    blocked = make_model("big-405b", gpus_per_node=8, nodes_per_replica=2, min_replicas=0).profiles.get()
    make_replica(blocked, state=ReplicaState.PENDING, error="needs 2 whole H100-80GB nodes on one fabric")
    return made


@pytest.fixture
def staff_api():
    user = get_user_model().objects.create_user("ops", password="pw", is_staff=True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def test_dashboard_panel_lists_candidates_and_the_idle_held_total(admin_client):
    watch_usage(known_since=ago(86400))
    [replica] = idle_fleet()
    html = admin_client.get("/admin/").content.decode()
    panel = html[html.index('id="what-can-i-stop"') :]
    panel = panel[: panel.index('<div class="module">')]
    assert "8 GPUs held by replicas idle over an hour (H100-80GB 8)." in panel
    assert f'<tr class="stoppable-row"><td>{replica.pk}</td><td>llama-70b</td><td>8</td><td>gpu-000</td>' in panel
    assert '<td title="2h00m">2 h</td><td>a whole H100-80GB node on ib-a</td><td>-</td>' in panel


def test_dashboard_panel_shows_ten_and_counts_the_rest(admin_client):
    watch_usage(known_since=ago(86400))
    idle_fleet(12)
    html = admin_client.get("/admin/").content.decode()
    assert html.count('class="stoppable-row"') == 10
    assert "… and 2 more (<code>manage.py ctl_status --all</code>)" in html
    # Each stop frees one whole node on ib-a; big-405b needs two, so no single stop unblocks it.
    assert "big-405b" not in html[html.index('id="what-can-i-stop"') : html.index("<h2>Replicas</h2>")]


def test_dashboard_panel_says_why_when_usage_is_unknown(admin_client):
    idle_fleet()
    html = admin_client.get("/admin/").content.decode()
    assert (
        '<p class="warn" id="usage-unknown">Usage is unknown (no tick has collected usage yet): nothing counts as idle,'
        in html
    )
    assert 'class="stoppable-row"' not in html


def test_status_api_carries_stoppable_idle_held_and_usage(staff_api):
    watch_usage(known_since=ago(86400))
    [replica] = idle_fleet()
    body = staff_api.get("/api/v1/status").json()
    expected = cluster_summary().as_json()
    assert body["usage"] == expected["usage"] and body["usage"]["known"] is True
    assert body["idle_held_gpus"] == expected["idle_held_gpus"]
    [entry] = body["stoppable"]
    assert entry["replica"] == replica.pk and entry["idle_seconds"] == pytest.approx(7200, abs=5)
    assert {k: v for k, v in entry.items() if k != "idle_seconds"} == {
        "replica": replica.pk,
        "model": "llama-70b",
        "gpu_class": "H100-80GB",
        "gpus": 8,
        "nodes": ["gpu-000"],
        "idle": "2h00m",
        "frees": "a whole H100-80GB node on ib-a",
        "unblocks": [],
    }


def count_queries(client, path) -> int:
    with CaptureQueriesContext(connection) as queries:
        assert client.get(path).status_code == 200
    return len(queries)


def test_status_api_queries_stay_constant_with_candidates(staff_api):
    watch_usage(known_since=ago(86400))
    idle_fleet(2)
    small = count_queries(staff_api, "/api/v1/status")
    profile = make_model("more", gpus_per_node=4, min_replicas=0, max_replicas=40).profiles.get()
    for i in range(20):
        node = make_node(f"more-{i}", fabric=f"ib-{i % 3}")
        make_replica(profile, placement=[(node, range(4))], last_used=ago(900))
    assert count_queries(staff_api, "/api/v1/status") == small
    assert len(staff_api.get("/api/v1/status").json()["stoppable"]) == 22


def test_metrics_carry_idle_held_gpus_per_class_and_usage_known(client):
    watch_usage(known_since=ago(86400))
    idle_fleet(2)
    samples = scrape(client)
    assert samples[("llmgw_idle_held_gpus", (("gpu_class", "H100-80GB"),))] == 16
    assert samples[("llmgw_idle_held_gpus", (("gpu_class", L40S),))] == 0
    assert samples[("llmgw_usage_known", ())] == 1
    for row in cluster_summary().as_json()["idle_held_gpus"]["by_class"]:
        assert samples[("llmgw_idle_held_gpus", (("gpu_class", row["gpu_class"]),))] == row["gpus"]


def test_metrics_drop_idle_held_to_zero_and_usage_known_to_zero_while_usage_is_unknown(client):
    watch_usage(known_since=None, reason="router r-2 lapsed")
    idle_fleet(2)
    samples = scrape(client)
    assert samples[("llmgw_usage_known", ())] == 0
    assert samples[("llmgw_idle_held_gpus", (("gpu_class", "H100-80GB"),))] == 0
