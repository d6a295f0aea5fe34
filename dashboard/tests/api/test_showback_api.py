"""The showback over REST, role by role: an operator sees every team, keys of no team, the idle time and the total;
anyone else the teams they belong to, and nothing of the fleet's; a bad month is a 400 naming the form."""

from datetime import UTC, datetime

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from dashboard.tests.api.test_self_service import client_for
from keys.models import ApiKey
from keys.showback import add_gpu_time
from keys.usage import store_tokens
from teams.models import Membership, Team

pytestmark = pytest.mark.django_db

URL = "/api/v1/showback/"
HOUR = int(datetime(2026, 11, 3, 10, tzinfo=UTC).timestamp())


@pytest.fixture
def clients():
    """Replica 1's hour shared 2:1:1 by search (bo a member), ads (cy a member) and a key of no team; replica 2's
    hour idle; an operator; a user of no team."""
    users = get_user_model().objects
    search, ads = Team.objects.create(name="search"), Team.objects.create(name="ads")
    bo, cy, dee = users.create_user("bo"), users.create_user("cy"), users.create_user("dee")
    Membership.objects.create(team=search, user=bo)
    Membership.objects.create(team=ads, user=cy)
    digests = [
        ApiKey.objects.get(pk=ApiKey.issue(name, team=team)[0].pk).key_hash
        for name, team in (("s", search), ("a", ads), ("n", None))
    ]
    add_gpu_time([(1, "llama", HOUR, 3600.0), (2, "qwen", HOUR, 900.0)])
    store_tokens({}, {}, {HOUR: {"1": dict(zip(digests, (200, 100, 100), strict=True))}})
    operator = users.create_user("ops", is_staff=True)
    return {name: client_for(user) for name, user in (("ops", operator), ("bo", bo), ("cy", cy), ("dee", dee))}


def rows(response) -> dict:
    assert response.status_code == 200, response.content
    return {(row["team"], row["model"]): (row["gpu_hours"], row["tokens"]) for row in response.json()["teams"]}


def test_an_operator_sees_every_team_no_teams_keys_the_idle_time_and_the_total(clients):
    response = clients["ops"].get(URL, {"month": "2026-11"})
    assert rows(response) == {
        ("search", "llama"): (0.5, 200),
        ("ads", "llama"): (0.25, 100),
        (None, "llama"): (0.25, 100),
    }
    assert response.json()["idle"] == [{"model": "qwen", "gpu_hours": 0.25}]
    assert (response.json()["month"], response.json()["total_gpu_hours"]) == ("2026-11", 1.25)


@pytest.mark.parametrize(
    ("who", "seen"),
    [("bo", {("search", "llama"): (0.5, 200)}), ("cy", {("ads", "llama"): (0.25, 100)}), ("dee", {})],
)
def test_anyone_else_sees_only_their_own_teams_and_nothing_of_the_fleets(clients, who, seen):
    response = clients[who].get(URL, {"month": "2026-11"})
    assert rows(response) == seen
    assert (response.json()["idle"], response.json()["total_gpu_hours"]) == ([], None)


def test_another_month_is_empty_and_a_bad_month_is_a_400_naming_the_form(clients):
    assert rows(clients["ops"].get(URL, {"month": "2026-10"})) == {}
    response = clients["ops"].get(URL, {"month": "November"})
    assert response.status_code == 400
    assert response.json() == {"month": ["must be YYYY-MM from 2000-01 to 2999-12, as 2026-11: got 'November'"]}


def test_nobody_signed_in_sees_nothing(clients):
    assert APIClient().get(URL).status_code in (401, 403)
