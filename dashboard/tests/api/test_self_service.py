"""The REST API for everyone signed in, role by role: a member sees and manages their own keys in their own
teams, a team's admin also the team's keys and members, an operator everything; nobody reads or changes another
team's keys, members or usage through any endpoint (another team's rows are 404, never a hint they exist)."""

import datetime as dt

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from keys.models import ApiKey, TokenUsage
from teams.models import Membership, Team

pytestmark = pytest.mark.django_db

HOUR = dt.datetime(2026, 12, 1, 10, tzinfo=dt.UTC)


def client_for(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


@pytest.fixture
def org():
    """Two teams: search (ana its admin, bo a member, each with a key) and ads (cy a member, with a key);
    an operator; usage on each key."""
    users = get_user_model().objects
    search, ads = Team.objects.create(name="search"), Team.objects.create(name="ads")
    ana, bo, cy = users.create_user("ana"), users.create_user("bo"), users.create_user("cy")
    ops = users.create_user("ops", is_staff=True)
    Membership.objects.create(team=search, user=ana, role=Membership.Role.ADMIN)
    Membership.objects.create(team=search, user=bo)
    Membership.objects.create(team=ads, user=cy)
    keys = {
        name: ApiKey.issue(name, team=team, user=user)[0]
        for name, team, user in (("ana-key", search, ana), ("bo-key", search, bo), ("cy-key", ads, cy))
    }
    for key in keys.values():
        TokenUsage.objects.create(key=key, key_name=key.name, model="llama", hour=HOUR, requests=1)
    return {"teams": {"search": search, "ads": ads}, "keys": keys} | {
        name: client_for(user) for name, user in (("ana", ana), ("bo", bo), ("cy", cy), ("ops", ops))
    }


def names(response) -> list[str]:
    assert response.status_code == 200, response.content
    return sorted(row.get("name") or row["key"] for row in response.json()["results"])


@pytest.mark.parametrize(
    ("who", "keys", "usage", "teams"),
    [
        ("bo", ["bo-key"], ["bo-key"], ["search"]),  # a member: their own
        ("ana", ["ana-key", "bo-key"], ["ana-key", "bo-key"], ["search"]),  # an admin: the team's
        ("cy", ["cy-key"], ["cy-key"], ["ads"]),
        ("ops", ["ana-key", "bo-key", "cy-key"], ["ana-key", "bo-key", "cy-key"], ["ads", "search"]),
    ],
)
def test_each_role_lists_only_its_keys_usage_and_teams(org, who, keys, usage, teams):
    client = org[who]
    assert names(client.get("/api/v1/keys/")) == keys
    assert names(client.get("/api/v1/usage/")) == usage
    assert names(client.get("/api/v1/teams/")) == teams


def test_another_teams_key_is_neither_read_nor_revoked(org):
    other = org["keys"]["cy-key"]
    assert org["bo"].get(f"/api/v1/keys/{other.pk}/").status_code == 404
    assert org["ana"].post(f"/api/v1/keys/{other.pk}/revoke/").status_code == 404
    assert org["bo"].post(f"/api/v1/keys/{org['keys']['ana-key'].pk}/revoke/").status_code == 404  # a colleague's
    assert ApiKey.objects.filter(active=False).count() == 0


def test_an_admin_revokes_a_key_of_the_team_and_a_member_their_own(org):
    assert org["ana"].post(f"/api/v1/keys/{org['keys']['bo-key'].pk}/revoke/").json()["active"] is False
    assert org["cy"].post(f"/api/v1/keys/{org['keys']['cy-key'].pk}/revoke/").json()["active"] is False


def test_a_member_creates_a_key_of_their_own_in_their_team_only(org):
    search, ads = org["teams"]["search"], org["teams"]["ads"]
    made = org["bo"].post("/api/v1/keys/", {"name": "bo-2", "team": search.pk}, format="json")
    assert made.status_code == 201 and made.json()["key"].startswith("sk-llmgw-")
    assert (made.json()["team"], made.json()["user"]) == (search.pk, org["keys"]["bo-key"].user_id)

    elsewhere = org["bo"].post("/api/v1/keys/", {"name": "bo-3", "team": ads.pk}, format="json")
    assert elsewhere.status_code == 403 and elsewhere.json()["detail"] == "You are not a member of the team “ads”."
    teamless = org["bo"].post("/api/v1/keys/", {"name": "bo-4"}, format="json")
    assert teamless.status_code == 400 and "team" in teamless.json()
    assert not ApiKey.objects.filter(name__in=["bo-3", "bo-4"]).exists()


def test_a_members_key_takes_its_teams_class_or_a_lower_one_and_an_operator_sets_any(org):
    search = org["teams"]["search"]  # standard, the default
    lower = org["bo"].post(
        "/api/v1/keys/", {"name": "bo-b", "team": search.pk, "priority_class": "batch"}, format="json"
    )
    assert lower.status_code == 201 and lower.json()["priority_class"] == "batch"
    higher = org["bo"].post(
        "/api/v1/keys/", {"name": "bo-i", "team": search.pk, "priority_class": "interactive"}, format="json"
    )
    assert higher.status_code == 403
    assert higher.json()["detail"] == (
        "A key of the team “search” may not ask for the interactive class, above the team's (standard); "
        "an operator sets a team's class."
    )
    assert not ApiKey.objects.filter(name="bo-i").exists()
    bad = org["bo"].post(
        "/api/v1/keys/", {"name": "bo-x", "team": search.pk, "priority_class": "urgent"}, format="json"
    )
    assert bad.status_code == 400 and "priority_class" in bad.json()
    made = org["ops"].post("/api/v1/keys/", {"name": "ops-i", "priority_class": "interactive"}, format="json")
    assert made.status_code == 201 and made.json()["priority_class"] == "interactive"


def test_members_are_managed_by_the_teams_admin_only(org):
    search, ads = org["teams"]["search"], org["teams"]["ads"]
    assert names_of(org["ana"].get(f"/api/v1/teams/{search.pk}/members/")) == [("ana", "admin"), ("bo", "member")]
    assert org["bo"].get(f"/api/v1/teams/{search.pk}/members/").status_code == 403  # a member, not an admin
    assert org["ana"].get(f"/api/v1/teams/{ads.pk}/members/").status_code == 404  # not her team
    assert org["cy"].post(f"/api/v1/teams/{search.pk}/members/", {"username": "cy"}, format="json").status_code == 404

    added = org["ana"].post(f"/api/v1/teams/{search.pk}/members/", {"username": "cy", "role": "member"}, format="json")
    assert added.status_code == 201 and added.json() == {"username": "cy", "role": "member"}
    again = org["ana"].post(f"/api/v1/teams/{search.pk}/members/", {"username": "cy"}, format="json")
    assert again.status_code == 400 and again.json() == {"username": ["cy is already in the team “search”."]}
    nobody = org["ana"].post(f"/api/v1/teams/{search.pk}/members/", {"username": "zed"}, format="json")
    assert nobody.status_code == 400 and nobody.json() == {"username": ["No user is named “zed”."]}

    assert org["bo"].delete(f"/api/v1/teams/{search.pk}/members/ana").status_code == 403
    assert org["ana"].delete(f"/api/v1/teams/{search.pk}/members/bo").status_code == 204
    assert ApiKey.objects.get(name="bo-key").active is False  # who leaves loses the team's keys


def names_of(response) -> list[tuple[str, str]]:
    assert response.status_code == 200, response.content
    return [(row["username"], row["role"]) for row in response.json()]


def test_the_fleet_stays_the_operators(org):
    for path in ("/api/v1/models/", "/api/v1/nodes/", "/api/v1/replicas/", "/api/v1/status/"):
        assert org["ana"].get(path).status_code == 403, path
    assert org["ops"].get("/api/v1/status/").status_code == 200


def test_listing_teams_takes_the_same_queries_for_one_team_and_for_many(org):
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert org["ops"].get("/api/v1/teams/").status_code == 200
        return len(captured)

    few = queries()
    for i in range(5):
        Team.objects.create(name=f"more-{i}")
    assert queries() == few
    roles = {row["name"]: row["role"] for row in org["ana"].get("/api/v1/teams/").json()["results"]}
    assert roles == {"search": "admin"}
    assert {row["role"] for row in org["ops"].get("/api/v1/teams/").json()["results"]} == {"operator"}
