"""Budgets over REST, role by role: an operator sees and changes every budget; a team's admin the team's own, its
members' and its keys'; a member sees the budgets that apply to them (their team's, their own, their keys') and
changes none; nobody sees another team's budgets (404, never a hint they exist). Writes are judged by Budget.clean,
a refusal naming the field; a list takes the same queries for one budget and for many."""

import threading
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from rest_framework.exceptions import ValidationError

from dashboard.api import writes
from dashboard.tests.api.test_self_service import client_for
from hub import get_hub
from keys.models import ApiKey, Budget
from teams.models import Membership, Team

pytestmark = pytest.mark.django_db

URL = "/api/v1/budgets/"


@pytest.fixture
def org():
    """Two teams: search (ana its admin, bo a member) and ads (cy a member), each member with a key; an operator;
    a budget for each team, each member within their team and each key."""
    users = get_user_model().objects
    search, ads = Team.objects.create(name="search"), Team.objects.create(name="ads")
    ana, bo, cy = users.create_user("ana"), users.create_user("bo"), users.create_user("cy")
    ops = users.create_user("ops", is_staff=True)
    Membership.objects.create(team=search, user=ana, role=Membership.Role.ADMIN)
    Membership.objects.create(team=search, user=bo)
    Membership.objects.create(team=ads, user=cy)
    keys = {}
    for team, user in ((search, ana), (search, bo), (ads, cy)):
        keys[user.username] = key = ApiKey.issue(f"{user.username}-key", team=team, user=user)[0]
        Budget.objects.create(key=key, amount=Decimal(1))
        Budget.objects.create(team=team, user=user, amount=Decimal(10), window=Budget.Window.DAY)
    for team in (search, ads):
        Budget.objects.create(team=team, amount=Decimal(100), timezone="Europe/Paris")
    budgets = {budget.scope_text(): budget for budget in Budget.objects.select_related("key", "team", "user")}
    clients = {name: client_for(user) for name, user in (("ana", ana), ("bo", bo), ("cy", cy), ("ops", ops))}
    rows = {"teams": {"search": search, "ads": ads}, "users": {"bo": bo, "cy": cy}, "keys": keys, "budgets": budgets}
    return rows | clients


def scopes(response) -> list[str]:
    assert response.status_code == 200, response.content
    return sorted(row["scope"] for row in response.json()["results"])


def url_of(org, scope: str) -> str:
    return f"{URL}{org['budgets'][scope].pk}/"


SEARCH = ["ana in team “search”", "bo in team “search”", "key “ana-key”", "key “bo-key”", "team “search”"]
ADS = ["cy in team “ads”", "key “cy-key”", "team “ads”"]


@pytest.mark.parametrize(
    ("who", "seen"),
    [
        ("ops", sorted(SEARCH + ADS)),  # everything
        ("ana", SEARCH),  # the admin: the team's, every member's, every key's
        ("bo", ["bo in team “search”", "key “bo-key”", "team “search”"]),  # a member: those that apply to him
        ("cy", ADS),
    ],
)
def test_each_role_lists_only_the_budgets_it_may_see(org, who, seen):
    assert scopes(org[who].get(URL)) == seen


def test_a_member_never_sees_another_teams_budgets(org):
    for scope in SEARCH:
        assert org["cy"].get(url_of(org, scope)).status_code == 404, scope
    for scope in [*ADS, "ana in team “search”", "key “ana-key”"]:  # another team's, and a colleague's
        assert org["bo"].get(url_of(org, scope)).status_code == 404, scope
    assert "ads" not in str(org["bo"].get(URL).json())


def test_a_budget_reads_with_its_scope_fields_and_window(org):
    budget = org["budgets"]["bo in team “search”"]
    row = org["bo"].get(url_of(org, "bo in team “search”")).json()
    assert row == {
        "id": budget.pk,
        "scope": "bo in team “search”",
        "key": None,
        "team": org["teams"]["search"].pk,
        "user": org["users"]["bo"].pk,
        "amount": "10.000000",
        "window": "day",
        "timezone": "UTC",
        "soft_limit_percent": None,
        "alert_url": "",
        "created_at": row["created_at"],
    }


# What each role gets from each endpoint on the budget of team search (and creating another of it).
@pytest.mark.parametrize(
    ("who", "retrieve", "create", "update", "delete"),
    [
        ("ops", 200, 201, 200, 204),
        ("ana", 200, 201, 200, 204),  # the team's admin
        ("bo", 200, 403, 403, 403),  # a member of it: sees it, changes nothing
        ("cy", 404, 403, 404, 404),  # a member of another team: it is not there
    ],
)
def test_each_role_may_do_with_a_teams_budget_what_its_role_allows(org, who, retrieve, create, update, delete):
    client, url = org[who], url_of(org, "team “search”")
    assert client.get(url).status_code == retrieve
    made = client.post(URL, {"team": org["teams"]["search"].pk, "amount": 3, "window": "week"}, format="json")
    assert made.status_code == create, made.content
    assert Budget.objects.filter(window="week").count() == (create == 201)
    changed = client.patch(url, {"amount": "250.5"}, format="json")
    assert changed.status_code == update, changed.content
    budget = org["budgets"]["team “search”"]
    assert Budget.objects.get(pk=budget.pk).amount == (Decimal("250.5") if update == 200 else Decimal(100))
    assert client.delete(url).status_code == delete
    assert Budget.objects.filter(pk=budget.pk).exists() == (delete != 204)


def test_a_member_changes_not_even_the_budgets_that_are_theirs(org):
    for scope in ("bo in team “search”", "key “bo-key”"):
        refused = org["bo"].patch(url_of(org, scope), {"amount": 1000}, format="json")
        assert refused.status_code == 403
        assert refused.json()["detail"].startswith("Only an operator or an admin of its team changes the budget of")
        assert org["bo"].delete(url_of(org, scope)).status_code == 403
    body = {"team": org["teams"]["search"].pk, "user": org["users"]["bo"].pk, "amount": 1}
    made = org["bo"].post(URL, body, format="json")
    assert made.status_code == 403 and "a team's admins set budgets" in made.json()["detail"]


def test_a_teams_admin_sets_its_members_and_keys_budgets_and_no_other_teams(org):
    search, ads = org["teams"]["search"], org["teams"]["ads"]
    member = org["ana"].post(
        URL, {"team": search.pk, "user": org["users"]["bo"].pk, "amount": "5", "window": "week"}, format="json"
    )
    assert member.status_code == 201 and member.json()["scope"] == "bo in team “search”"
    key = org["ana"].post(URL, {"key": org["keys"]["bo"].pk, "amount": 2, "window": "day"}, format="json")
    assert key.status_code == 201 and key.json()["scope"] == "key “bo-key”"

    elsewhere = org["ana"].post(URL, {"team": ads.pk, "amount": 5, "window": "week"}, format="json")
    assert elsewhere.status_code == 403
    assert elsewhere.json() == {"team": ["Only an admin of the team “ads” sets its budgets."]}
    moved = org["ana"].patch(url_of(org, "team “search”"), {"team": ads.pk}, format="json")
    assert moved.status_code == 403 and list(moved.json()) == ["team"]
    # Another team's key and member are no rows to her: refused as ids that exist nowhere.
    other_key = org["ana"].post(URL, {"key": org["keys"]["cy"].pk, "amount": 5, "window": "week"}, format="json")
    assert other_key.status_code == 400 and list(other_key.json()) == ["key"]
    other_user = org["ana"].post(
        URL, {"team": search.pk, "user": org["users"]["cy"].pk, "amount": 5, "window": "week"}, format="json"
    )
    assert other_user.status_code == 400 and list(other_user.json()) == ["user"]
    assert org["ana"].patch(url_of(org, "team “ads”"), {"amount": 1}, format="json").status_code == 404
    assert Budget.objects.count() == 10


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"team": "search", "user": "cy"}, "user", "cy is not a member of the team “search”."),
        ({"team": "search", "timezone": "Mars/Olympus"}, "timezone", "Unknown time zone “Mars/Olympus”"),
        ({"team": "search", "key": "cy"}, "key", "A key's budget names no team or user"),
        ({}, "team", "A budget is a team's, a member's within a team, or a key's: name one."),
        ({"team": "search", "window": "month"}, "window", "There is a budget of team “search” for the window “month”"),
        ({"team": "search", "amount": -1}, "amount", "A budget cannot be negative."),
        ({"team": "search", "amount": True}, "amount", "expected a number such as 0.15"),
        ({"team": "search", "soft_limit_percent": 120}, "soft_limit_percent", "less than or equal to 100"),
        ({"team": "search", "window": "year"}, "window", "expected one of"),
        ({"team": "search", "alert_url": "not a url"}, "alert_url", "Enter a valid URL."),
        ({"team": "search", "owner": "ana"}, "owner", "unknown key"),
    ],
)
def test_a_bad_budget_is_a_400_naming_the_field(org, body, field, message):
    ids = {"team": org["teams"], "user": org["users"], "key": org["keys"]}
    body = {"amount": 5, "window": "week"} | {
        name: ids[name][value].pk if name in ids else value for name, value in body.items()
    }
    refused = org["ops"].post(URL, body, format="json")
    assert refused.status_code == 400
    assert list(refused.json()) == [field] and message in refused.json()[field][0], refused.json()
    assert Budget.objects.count() == 8


def test_an_operator_sets_the_budget_of_a_key_of_no_team_and_moves_budgets_between_teams(org):
    loose = ApiKey.issue("loose")[0]
    made = org["ops"].post(URL, {"key": loose.pk, "amount": "0.5", "window": "none"}, format="json")
    assert made.status_code == 201 and made.json()["scope"] == "key “loose”" and made.json()["amount"] == "0.500000"
    refused = org["ana"].post(URL, {"key": loose.pk, "amount": 1}, format="json")
    assert refused.status_code == 400  # not her key to see
    moved = org["ops"].put(
        url_of(org, "team “search”"),
        {"team": org["teams"]["ads"].pk, "amount": 7, "window": "week", "soft_limit_percent": 80},
        format="json",
    )
    assert moved.status_code == 200, moved.content
    assert (moved.json()["scope"], moved.json()["soft_limit_percent"]) == ("team “ads”", 80)


def test_a_budget_written_through_the_api_reaches_the_routers(org, monkeypatch, django_capture_on_commit_callbacks):
    heard: list[list[str]] = []
    monkeypatch.setattr(get_hub(), "publish_key_changes", heard.append)
    with django_capture_on_commit_callbacks(execute=True):
        made = org["ana"].post(URL, {"team": org["teams"]["search"].pk, "amount": 3, "window": "week"}, format="json")
    assert made.status_code == 201
    assert sorted(d for batch in heard for d in batch) == sorted(org["keys"][n].key_hash for n in ("ana", "bo"))


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_budgets_of_one_scope_and_window_made_at_once_are_one(org):
    """Requests that each find the window free and save at the same moment: one budget, the others a 400."""
    ops, search = get_user_model().objects.get(username="ops"), org["teams"]["search"]
    barrier, outcomes = threading.Barrier(6), []

    def make():
        try:
            barrier.wait(5)
            writes.save_budget(ops, Budget(team=search, amount=Decimal(1), window=Budget.Window.WEEK))
            outcomes.append("made")
        except ValidationError as exc:
            outcomes.append(list(exc.detail))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=make) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(outcomes, key=str) == [*[["window"]] * 5, "made"]
    assert Budget.objects.filter(team=search, user=None, window=Budget.Window.WEEK).count() == 1


@pytest.mark.parametrize("who", ["ops", "ana", "bo"])
def test_listing_budgets_takes_the_same_queries_for_one_budget_and_for_many(org, who):
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert org[who].get(URL).status_code == 200
        return len(captured)

    few = queries()
    search, users = org["teams"]["search"], get_user_model().objects
    for i in range(5):
        user = users.create_user(f"more-{i}")
        Membership.objects.create(team=search, user=user)
        key = ApiKey.issue(f"more-{i}", team=search, user=user)[0]
        Budget.objects.create(team=search, user=user, amount=Decimal(1))
        Budget.objects.create(key=key, amount=Decimal(1))
    for window in ("week", "none"):
        Budget.objects.create(team=search, user=org["users"]["bo"], amount=Decimal(1), window=window)
    assert queries() == few
    assert len(org[who].get(URL).json()["results"]) > (3 if who == "bo" else 8)
