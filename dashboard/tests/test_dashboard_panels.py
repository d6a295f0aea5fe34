"""The dashboard panels: human times, short ids, failed replicas, usage chart, the fragment view and `/`."""

import re
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from dashboard.panels import (
    CHART_WIDTH,
    failed_replicas,
    humanize_ago,
    humanize_duration,
    short_id,
    usage_by_model,
    usage_window_start,
)
from dashboard.views import REPLICAS_SHOWN
from keys.models import TokenUsage
from reconciler.choices import ReplicaState
from reconciler.models import Lease, Replica
from tests.fleet import bulk_fleet, make_model, make_node, make_replica

NOW = datetime(2026, 11, 30, 7, 40, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "-"),
        (-1.0, "-"),
        (0, "0 s"),
        (59.9, "59 s"),
        (60, "1 min"),
        (3599, "59 min"),
        (3600, "1 h"),
        (7500, "2 h 5 min"),
        (86400, "1 d"),
        (86400 * 2 + 3600 * 4 + 59, "2 d 4 h"),
    ],
)
def test_humanize_duration(seconds, text):
    assert humanize_duration(seconds) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "-"),
        (NOW - timedelta(seconds=2), "just now"),
        (NOW + timedelta(seconds=3), "just now"),
        (NOW - timedelta(minutes=3, seconds=20), "3 min ago"),
        (NOW + timedelta(seconds=40), "in 40 s"),
        ((NOW - timedelta(hours=5)).isoformat(), "5 h ago"),
    ],
)
def test_humanize_ago_takes_datetimes_and_iso_strings(value, text):
    assert humanize_ago(value, NOW) == text


def test_short_id_cuts_to_eight_and_keeps_the_whole():
    assert short_id("cp-7f3a9c2e41d84b6f") == {"short": "cp-7f3a9…", "full": "cp-7f3a9c2e41d84b6f"}
    assert short_id("cp-1") == {"short": "cp-1", "full": "cp-1"}
    assert short_id(None) == {"short": "", "full": ""}


def test_usage_window_is_whole_hourly_buckets_covering_the_last_hour():
    assert usage_window_start(NOW) == datetime(2026, 11, 30, 6, 0, tzinfo=UTC)


def _usage(model, hour, requests, prompt, completion, key_name="team-a"):
    return TokenUsage.objects.create(
        key_name=key_name,
        model=model,
        hour=hour,
        requests=requests,
        prompt_tokens=prompt,
        completion_tokens=completion,
    )


@pytest.mark.django_db
def test_usage_by_model_sums_keys_in_the_window_and_scales_bars_to_the_busiest():
    this_hour = NOW.replace(minute=0)
    _usage("llama-70b", this_hour, 10, 1000, 500)
    _usage("llama-70b", this_hour - timedelta(hours=1), 30, 2000, 500, key_name="team-b")
    _usage("qwen-7b", this_hour, 80, 600, 400)
    _usage("qwen-7b", this_hour - timedelta(hours=2), 999, 99999, 99999)  # before the window
    chart = usage_by_model(NOW)
    rows = {r["model"]: r for r in chart["rows"]}
    assert [r["model"] for r in chart["rows"]] == ["llama-70b", "qwen-7b"]  # most tokens first
    assert (rows["llama-70b"]["requests"], rows["llama-70b"]["tokens"]) == (40, 4000)
    assert (rows["qwen-7b"]["requests"], rows["qwen-7b"]["tokens"]) == (80, 1000)
    assert rows["llama-70b"]["tokens_width"] == CHART_WIDTH and rows["qwen-7b"]["tokens_width"] == CHART_WIDTH // 4
    assert rows["qwen-7b"]["requests_width"] == CHART_WIDTH and rows["llama-70b"]["requests_width"] == CHART_WIDTH // 2


@pytest.mark.django_db
def test_usage_by_model_is_empty_without_traffic():
    assert usage_by_model(NOW)["rows"] == []


def test_root_redirects_to_the_dashboard(client):
    response = client.get("/")
    assert response.status_code == 302 and response["Location"] == "/admin/"


@pytest.mark.django_db
def test_panels_fragment_is_for_staff_only(client):
    assert client.get("/admin/panels/")["Location"].startswith("/admin/login/")
    user = get_user_model().objects.create_user("dev", password="pw", is_staff=False)
    client.force_login(user)
    response = client.get("/admin/panels/")
    assert response.status_code == 302 and response["Location"].startswith("/admin/login/")


def _fleet(nodes, replicas_per_node):
    profile = make_model(f"m-{nodes}", gpus_per_node=1, min_replicas=0).profiles.get()
    for n in range(nodes):
        node = make_node(f"gpu-{nodes}-{n}", gpus=replicas_per_node + 1, fabric="ib-a")
        for i in range(replicas_per_node):
            make_replica(profile, placement=[(node, [i])], last_used=timezone.now())
    failed = make_replica(profile, state=ReplicaState.FAILED)
    Replica.objects.filter(pk=failed.pk).update(last_error="engine exited 137 (OOM)", failure_count=2)
    _usage(profile.model.name, timezone.now().replace(minute=0, second=0, microsecond=0), 5, 50, 50)


def _panels_queries(client):
    with CaptureQueriesContext(connection) as queries:
        response = client.get("/admin/panels/")
    assert response.status_code == 200
    return response, len(queries)


@pytest.mark.django_db
def test_panels_fragment_runs_the_same_queries_whatever_the_fleet_size(admin_client):
    _fleet(1, 1)
    _, small = _panels_queries(admin_client)
    _fleet(6, 3)
    response, large = _panels_queries(admin_client)
    assert small == large <= 20
    html = response.content.decode()
    # A fragment: the panels without the admin page around them.
    assert "<html" not in html and 'id="capacity"' in html
    assert response["Cache-Control"].startswith("max-age=0")


@pytest.mark.django_db
def test_panels_show_failed_reasons_usage_legend_and_a_short_leader_id(admin_client, settings):
    _fleet(1, 1)
    Lease.objects.create(
        name=settings.LLMGW_LEASE_NAME,
        owner="cp-7f3a9c2e41d84b6f",
        epoch=4,
        expires_at=timezone.now().timestamp() + 30,
    )
    html = admin_client.get("/admin/panels/").content.decode()
    assert '<code id="leader-id" title="cp-7f3a9c2e41d84b6f">cp-7f3a9…</code>' in html
    assert re.search(r"lease renews, expires in (29|30) s", html)
    failed = html[html.index('id="failed-replicas"') :]
    assert re.search(r"<td>m-1</td><td>2</td><td>-</td><td>engine exited 137 \(OOM\)</td>", failed)
    for state, char in (("used", "#"), ("unhealthy", "!"), ("unavailable", "x"), ("free", "-")):
        assert f'<i class="{state}"></i><code>{char}</code> {state}' in html
    usage = html[html.index('id="usage"') :]
    assert "<svg" in usage and '<g class="usage-row" data-model="m-1">' in usage
    assert "<title>m-1: 5 requests, 100 tokens</title>" in usage
    assert f'class="tokens" x="170" y="14" width="{CHART_WIDTH}"' in usage
    # Replica rows: when it became ready and was last used, in words.
    assert re.search(r'<td title="[^"]+">just now</td>\s*<td title="[^"]+">just now</td><td>0 s</td></tr>', html)


@pytest.mark.django_db
def test_panels_say_when_the_lease_expired(admin_client, settings):
    Lease.objects.create(
        name=settings.LLMGW_LEASE_NAME, owner="cp-1", epoch=2, expires_at=timezone.now().timestamp() - 180
    )
    html = admin_client.get("/admin/panels/").content.decode()
    assert '<span class="warn">lease expired 3 min ago</span>' in html


@pytest.mark.django_db
def test_the_index_includes_the_panels_and_the_fetch_loop(admin_client):
    html = admin_client.get("/admin/").content.decode()
    assert '<div id="fleet-panels">' in html and 'id="capacity"' in html
    assert 'data-refresh-ms="5000"' in html
    assert re.search(r'<script src="/static/dashboard/live\.js" defer></script>', html)
    assert 'http-equiv="refresh"' not in html  # live by fetch, not by reloading the page


@pytest.mark.django_db
def test_replica_panel_lists_fifty_not_ready_first_and_counts_the_rest(admin_client):
    bulk_fleet(13, replicas=52)
    failed = make_replica(Replica.objects.first().profile, state=ReplicaState.FAILED)
    html = admin_client.get("/admin/panels/").content.decode()
    panel = html[html.index("<h2>Replicas</h2>") : html.index('id="usage"')]
    rows = re.findall(r"<tr><td>(\d+)</td>", panel)
    assert len(rows) == REPLICAS_SHOWN and rows[0] == str(failed.pk)
    assert "… and 3 more; those not ready are listed first" in panel


@pytest.mark.django_db
def test_usage_chart_groups_thousands(admin_client):
    _usage("llama-70b", timezone.now().replace(minute=0, second=0, microsecond=0), 1200, 50000, 20000)
    usage = admin_client.get("/admin/panels/").content.decode().split('id="usage"')[1]
    assert ">1,200 req</text>" in usage and ">70,000 tok</text>" in usage


@pytest.mark.django_db
def test_failed_replica_next_attempt_reads_in_words_or_due():
    profile = make_model("m", min_replicas=0).profiles.get()
    for due in (timezone.now() + timedelta(seconds=90), timezone.now() - timedelta(minutes=2), None):
        replica = make_replica(profile, state=ReplicaState.FAILED)
        Replica.objects.filter(pk=replica.pk).update(next_attempt_at=due)
    assert [f["retry"] for f in failed_replicas(timezone.now())] == ["in 1 min", "due", "-"]


@pytest.mark.django_db
def test_panels_fragment_only_answers_get(admin_client):
    response = admin_client.post("/admin/panels/")
    assert response.status_code == 405 and response["Allow"] == "GET"
