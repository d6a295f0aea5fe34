"""Stream continuations of the last hour on every operator surface, from the one summary: per model, how many
answers whose engine broke off were continued, ended with an error or refused, and the prompt tokens re-read."""

import json
from datetime import UTC, datetime, timedelta
from io import StringIO
from types import SimpleNamespace

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from dashboard.summary import cluster_summary
from dashboard.summary_types import ModelContinuations
from keys.models import ContinuationHour

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 3, 1, 11, 20, tzinfo=UTC)


def broke(model, hour, continued=0, failed=0, refused=0, reprocessed=0):
    ContinuationHour.objects.create(
        model=model,
        hour=hour,
        continued=continued,
        failed=failed,
        refused=refused,
        reprocessed_prompt_tokens=reprocessed,
    )


@pytest.fixture(autouse=True)
def frozen(monkeypatch):
    """Every surface's summary is made at NOW, so the window is the same whenever the test runs."""
    for module in ("dashboard.summary", "dashboard.views"):
        monkeypatch.setattr(f"{module}.timezone", SimpleNamespace(now=lambda: NOW))


@pytest.fixture
def broken():
    """Rows of this hour and the previous one (the window, since 10:00), and one of the hour before, outside it."""
    this_hour = NOW.replace(minute=0)
    broke("llama", this_hour, continued=3, failed=1, reprocessed=900)
    broke("llama", this_hour - timedelta(hours=1), continued=2, refused=1, reprocessed=100)
    broke("qwen", this_hour, refused=1)
    broke("mistral", this_hour - timedelta(hours=2), failed=50)  # before the window


def test_the_summary_sums_the_last_hour_per_model_most_broken_first(broken):
    continuations = cluster_summary().continuations
    assert continuations.since == "2026-03-01T10:00:00+00:00"
    assert continuations.models == [
        ModelContinuations("llama", continued=5, failed=1, refused=1, reprocessed_prompt_tokens=1000),
        ModelContinuations("qwen", continued=0, failed=0, refused=1, reprocessed_prompt_tokens=0),
    ]


def test_the_summary_has_none_and_still_says_since_when_without_breaks():
    continuations = cluster_summary().continuations
    assert (continuations.since, continuations.models) == ("2026-03-01T10:00:00+00:00", [])


def status_text(*args) -> list[str]:
    out = StringIO()
    call_command("ctl_status", *args, stdout=out)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Stream continuations"))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def test_ctl_status_prints_a_line_per_model(broken):
    assert [" ".join(line.split()) for line in status_text()] == [
        "Stream continuations (since 10:00 UTC)",
        "MODEL CONTINUED FAILED REFUSED PROMPT TOKENS RE-READ",
        "llama 5 1 1 1000",
        "qwen 0 0 1 0",
    ]


def test_ctl_status_says_none_without_breaks():
    assert status_text()[1:] == ["  none: no engine broke off an answer"]


def test_ctl_status_json_and_the_rest_api_carry_them(broken):
    user = get_user_model().objects.create_user("ops", password="pw", is_staff=True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    answered = client.get("/api/v1/status").json()["continuations"]
    out = StringIO()
    call_command("ctl_status", "--json", stdout=out)
    printed = json.loads(out.getvalue())["continuations"]
    for continuations in (answered, printed):
        assert continuations["models"][0] == {
            "model": "llama",
            "continued": 5,
            "failed": 1,
            "refused": 1,
            "reprocessed_prompt_tokens": 1000,
        }
        assert [m["model"] for m in continuations["models"]] == ["llama", "qwen"]
        assert continuations["since"] == "2026-03-01T10:00:00+00:00"


def test_the_dashboard_shows_a_row_per_model_errors_marked(broken, admin_client):
    html = admin_client.get("/admin/panels/").content.decode().split('id="continuations"')[1]
    assert "since 10:00 UTC" in html
    rows = html.split('class="continuation-row')[1:]
    assert len(rows) == 2
    assert rows[0].startswith(' warn"><td>llama</td><td>5</td><td>1</td><td>1</td><td>1000</td>')
    assert rows[1].startswith(' warn"><td>qwen</td>')


def test_the_dashboard_says_none_without_breaks(admin_client):
    html = admin_client.get("/admin/panels/").content.decode()
    assert 'id="continuations-none"' in html
