"""The per-request log in the database: records taken from the hub are stored with their key's team and holder,
rows past LLMGW_REQUEST_RECORD_DAYS are deleted, what the database refuses goes back to the hub, and nothing is
taken when records are not kept."""

import asyncio
from datetime import UTC, datetime, timedelta
from unittest import mock

import pytest
from django.contrib.auth.models import User
from django.db import DatabaseError
from django.test import override_settings

from hub import InProcessHub
from hub.contracts import RequestRecord as Record
from hub.contracts import UsageReport
from keys.models import ApiKey, RequestRecord
from keys.records import forget_old_records, record_requests
from teams.models import Membership, Team

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 12, 4, 12, tzinfo=UTC)


def record(digest: str, at: datetime = NOW, **fields) -> Record:
    values = {"model": "llama", "status": 200, "prompt": 10, "completion": 5, "spend": 7, "milliseconds": 42}
    return Record(at=at.timestamp(), key=digest, **(values | fields))


def reported(hub: InProcessHub, *records: Record) -> None:
    asyncio.run(hub.report_usage(UsageReport(router="r", records=list(records))))


@override_settings(LLMGW_REQUEST_RECORD_DAYS=7)
def test_records_are_stored_with_the_keys_team_and_holder():
    team, ada = Team.objects.create(name="ml"), User.objects.create_user("ada")
    Membership.objects.create(team=team, user=ada)
    key, _ = ApiKey.issue("ada's", team=team, user=ada)
    hub = InProcessHub()
    reported(hub, record(key.key_hash), record("gone", status=499, completion=0))
    assert record_requests(hub) == 2
    first, second = RequestRecord.objects.order_by("id")
    assert (first.key, first.team, first.user, first.model, first.status) == (key, team, ada, "llama", 200)
    assert (first.prompt_tokens, first.completion_tokens, first.spend_units, first.milliseconds) == (10, 5, 7, 42)
    assert first.at == NOW
    assert (second.key, second.team, second.status) == (None, None, 499)  # its key deleted since: kept without
    assert hub.take_records() == []  # taken


def test_rows_past_their_days_are_deleted():
    key, _ = ApiKey.issue("k")
    RequestRecord.objects.bulk_create(
        RequestRecord(at=NOW - timedelta(days=age), key=key, model="m", status=200, prompt_tokens=1,
                      completion_tokens=1, spend_units=0, milliseconds=1)
        for age in (0, 6, 7.5, 30)
    )  # fmt: skip
    assert forget_old_records(7, NOW) == 2
    assert sorted((NOW - row.at).days for row in RequestRecord.objects.all()) == [0, 6]


@override_settings(LLMGW_REQUEST_RECORD_DAYS=7)
def test_what_the_database_refuses_goes_back_to_the_hub():
    hub = InProcessHub()
    reported(hub, record("a"), record("b"))
    with mock.patch("keys.records.store_records", side_effect=DatabaseError("disk full")):
        assert record_requests(hub) == 0
    assert [r.key for r in hub.take_records()] == ["a", "b"]


@override_settings(LLMGW_REQUEST_RECORD_DAYS=0)
def test_nothing_is_taken_when_records_are_not_kept():
    hub = InProcessHub()
    reported(hub, record("a"))
    assert record_requests(hub) == 0 and len(hub.take_records()) == 1
