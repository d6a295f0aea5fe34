"""Token usage on the operator surfaces: /api/v1/usage/ (filtered, paginated, constant queries) and llmgw_tokens_total."""

from datetime import UTC, datetime

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from dashboard.metrics import tokens_family
from dashboard.tests.test_metrics import scrape
from keys.models import ApiKey, TokenUsage

pytestmark = pytest.mark.django_db

H0 = datetime(2026, 3, 1, 10, tzinfo=UTC)
H1 = datetime(2026, 3, 1, 11, tzinfo=UTC)


@pytest.fixture
def staff_client():
    user = get_user_model().objects.create_user("ops", password="pw", is_staff=True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def usage(key, model, hour, requests=1, prompt=10, completion=20):
    return TokenUsage.objects.create(
        key=key,
        key_name=key.name,
        model=model,
        hour=hour,
        requests=requests,
        prompt_tokens=prompt,
        completion_tokens=completion,
    )


@pytest.fixture
def spent():
    alice, bob = ApiKey.issue("alice")[0], ApiKey.issue("bob")[0]
    usage(alice, "llama", H0)
    usage(alice, "llama", H1, prompt=5, completion=1)
    usage(alice, "qwen", H1, prompt=7, completion=0)
    usage(bob, "llama", H1, requests=3, prompt=100, completion=200)
    return alice, bob


def test_usage_lists_rows_newest_hour_first(staff_client, spent):
    response = staff_client.get("/api/v1/usage/")
    assert response.status_code == 200
    body = response.json()
    assert body["count"] == 4
    first = body["results"][0]
    assert first["hour"].startswith("2026-03-01T11:00:00")
    assert set(first) == {
        "id", "key", "key_id", "model", "hour", "requests", "prompt_tokens", "completion_tokens", "spend", "team",
        "user",
    }  # fmt: skip
    assert first["spend"] == "0.000000000000"  # no prices in this catalog
    assert [(r["key"], r["model"]) for r in body["results"]] == [
        ("alice", "llama"),
        ("alice", "qwen"),
        ("bob", "llama"),
        ("alice", "llama"),
    ]


def test_usage_filters_by_key_model_and_since(staff_client, spent):
    def listed(query):
        return [
            (r["key"], r["model"], r["hour"][11:13])
            for r in staff_client.get(f"/api/v1/usage/?{query}").json()["results"]
        ]

    assert listed("key=bob") == [("bob", "llama", "11")]
    assert listed("model=qwen") == [("alice", "qwen", "11")]
    assert listed("key=alice&model=llama") == [("alice", "llama", "11"), ("alice", "llama", "10")]
    # A time inside an hour includes that hour; a date is its midnight UTC.
    assert len(listed("since=2026-03-01T11:30:00Z")) == 3
    assert len(listed("since=2026-03-01t11:30:00.5z")) == 3  # RFC 3339 allows either case
    assert len(listed("since=2026-03-01T11:30:00%2B01:00")) == 4
    assert len(listed("since=2026-03-01")) == 4
    assert listed("since=2026-03-02") == []


@pytest.mark.parametrize(
    "since",
    # Not the schema's RFC 3339 date-time or date: an offset is required, a day must exist, and empty is no date.
    ["yesterday", "2026-03-01T11:30:00", "2026-03-01 11:30:00Z", "2026-02-30", "x2026-03-01", ""],
)
def test_a_since_the_schema_does_not_allow_is_a_400_naming_it(staff_client, since):
    response = staff_client.get("/api/v1/usage/", {"since": since})
    assert response.status_code == 400
    assert "is not an RFC 3339 date-time or a date" in response.json()["since"]


@pytest.mark.parametrize(("since", "rows"), [("0001-01-01T00:00:00+01:00", 4), ("9999-12-31T23:59:59-23:59", 0)])
def test_a_since_past_the_calendars_ends_reads_as_its_end(staff_client, spent, since, rows):
    response = staff_client.get("/api/v1/usage/", {"since": since})
    assert response.status_code == 200 and response.json()["count"] == rows


def test_usage_is_paginated_and_runs_constant_queries(staff_client):
    key = ApiKey.issue("alice")[0]

    def queries():
        with CaptureQueriesContext(connection) as captured:
            assert staff_client.get("/api/v1/usage/?limit=2").status_code == 200
        return len(captured)

    usage(key, "m0", H0)
    few = queries()
    for i in range(1, 30):
        usage(key, f"m{i}", H0)
    assert queries() == few
    body = staff_client.get("/api/v1/usage/?limit=2").json()
    assert body["count"] == 30 and len(body["results"]) == 2 and body["next"]


def test_usage_refuses_unauthenticated_requests():
    assert APIClient().get("/api/v1/usage/").status_code in (401, 403)


def test_tokens_total_sums_the_stored_rows_per_model_and_key_name(client, spent):
    samples = scrape(client)

    def tokens(model, key, kind):
        return samples[("llmgw_tokens_total", (("key", key), ("kind", kind), ("model", model)))]

    assert tokens("llama", "alice", "prompt") == 15
    assert tokens("llama", "alice", "completion") == 21
    assert tokens("qwen", "alice", "prompt") == 7
    assert tokens("llama", "bob", "completion") == 200


def test_tokens_total_costs_one_query_whatever_the_rows(client, spent):
    with CaptureQueriesContext(connection) as captured:
        family = tokens_family()
    assert len(captured) == 1
    assert len(family.samples) == 3 * 2


def test_admin_lists_token_usage_read_only(admin_client, spent):
    response = admin_client.get("/admin/keys/tokenusage/?key_name=bob")
    assert response.status_code == 200
    assert [row.key_name for row in response.context["cl"].result_list] == ["bob"]
    assert admin_client.get("/admin/keys/tokenusage/add/").status_code == 403
