"""The /metrics endpoints: the token, the fleet gauges, and the sample Grafana dashboard's names and rows."""

import json
import re
from pathlib import Path

import httpx
import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from hub import InProcessHub
from reconciler.choices import ReplicaState
from reconciler.models import Lease
from router.app import create_app
from router.metrics import metrics_token_ok
from router.tests.conftest import RouterServer
from tests.fleet import make_model, make_node, make_replica

GRAFANA = Path(__file__).resolve().parents[2] / "dashboard" / "grafana" / "llmgw.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
PROMQL_WORDS = {"le"}


def exposed_names(text: str) -> set[str]:
    """Every sample name the exposition can carry, from its TYPE lines (families without samples too)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
    return names


def values(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.django_db
def test_without_a_token_control_plane_metrics_are_open(client, settings):
    settings.LLMGW_METRICS_TOKEN = ""
    assert client.get("/metrics").status_code == 200


@pytest.mark.django_db
@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic s3cret", "s3cret", "Bearer "])
def test_with_a_token_control_plane_metrics_refuse_anything_but_the_bearer_token(client, settings, header):
    settings.LLMGW_METRICS_TOKEN = "s3cret"
    response = client.get("/metrics", **({"HTTP_AUTHORIZATION": header} if header is not None else {}))
    assert response.status_code == 401 and response["WWW-Authenticate"] == "Bearer"
    assert b"LLMGW_METRICS_TOKEN" in response.content and b"llmgw_" not in response.content
    ok = client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret")
    assert ok.status_code == 200 and b"llmgw_gpus" in ok.content


def test_the_router_token_check():
    assert metrics_token_ok([], "")
    assert metrics_token_ok([(b"authorization", b"Bearer s3cret")], "s3cret")
    assert metrics_token_ok([(b"authorization", b"bearer s3cret")], "s3cret")
    assert not metrics_token_ok([], "s3cret")
    assert not metrics_token_ok([(b"authorization", b"Bearer s3cre")], "s3cret")
    assert not metrics_token_ok([(b"authorization", b"Basic s3cret")], "s3cret")


def test_a_real_router_answers_401_on_metrics_without_the_token(settings):
    settings.LLMGW_METRICS_TOKEN = "s3cret"
    router = RouterServer(create_app(InProcessHub())).start()
    try:
        refused = httpx.get(f"{router.url}/metrics")
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert refused.json()["error"]["code"] == "invalid_metrics_token"
        assert httpx.get(f"{router.url}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = httpx.get(f"{router.url}/metrics", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and "llmgw_router_requests_total" in ok.text
        assert httpx.get(f"{router.url}/health").status_code == 200  # only /metrics is behind the token
    finally:
        router.stop()


@pytest.mark.django_db
def test_lease_and_unplaceable_gauges(client, settings):
    settings.LLMGW_METRICS_TOKEN = ""
    assert ("llmgw_lease_epoch", ()) not in values(client.get("/metrics").content.decode())  # no lease yet
    Lease.objects.create(
        name=settings.LLMGW_LEASE_NAME, owner="cp-7", epoch=4, expires_at=timezone.now().timestamp() + 10
    )
    make_node("gpu-a", gpus=2)
    profile = make_model("big", gpus_per_node=8, min_replicas=0).profiles.get()
    make_replica(profile, state=ReplicaState.PENDING, error="needs 8 GPUs on one node")
    got = values(client.get("/metrics").content.decode())
    assert got[("llmgw_lease_epoch", ())] == 4
    assert got[("llmgw_lease_holder", (("owner", "cp-7"),))] == 1
    assert 0 < got[("llmgw_lease_expires_in_seconds", ())] <= 10
    assert got[("llmgw_unplaceable_models", ())] == 1
    assert got[("llmgw_replicas", (("state", "pending"),))] == 1


@pytest.mark.django_db
def test_every_metric_the_grafana_dashboard_queries_is_exposed(client, settings):
    settings.LLMGW_METRICS_TOKEN = ""
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]  # a row has none
    queried = {name for expr in exprs for name in re.findall(r"\b(llmgw_[a-z0-9_]+)\b", expr)}
    assert len(queried) >= 15
    exposed = exposed_names(client.get("/metrics").content.decode())
    exposed |= exposed_names(create_app(InProcessHub()).state.metrics.render().decode())
    assert sorted(queried - exposed) == []


def test_the_grafana_teams_row_charts_every_team_metric():
    panels = json.loads(GRAFANA.read_text())["panels"]
    row = next(i for i, panel in enumerate(panels) if panel["type"] == "row" and panel["title"] == "Teams")
    below = panels[row + 1 :]
    below = below[: next((i for i, panel in enumerate(below) if panel["type"] == "row"), len(below))]
    exprs = " ".join(t["expr"] for panel in below for t in panel["targets"])
    for name in ("llmgw_team_spend", "llmgw_team_budget_used_ratio", "llmgw_team_budgets_exhausted"):
        assert name in exprs
    assert 'window="day"' in exprs and 'window="month"' in exprs
    assert all(panel["gridPos"]["y"] > panels[row]["gridPos"]["y"] for panel in below)
    assert len({panel["id"] for panel in panels}) == len(panels)


def test_metric_names_follow_prometheus_conventions():
    """Counters end in _total, seconds are the time unit, and no gauge pretends to be a counter."""
    text = create_app(InProcessHub()).state.metrics.render().decode()
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("llmgw_router_")
        assert not re.search(r"_(ms|milliseconds|minutes)$", family.name)
        if family.type == "gauge":
            assert not family.name.endswith("_total")
