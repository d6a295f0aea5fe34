"""Budgets in the admin: added for a key, a member or a team, listed with whose they are in words, searched by
team, user and key, filtered by window; a form Budget.clean refuses says why on the field at fault; a team's
page carries the team's budget and its members'."""

from decimal import Decimal

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

from keys.models import ApiKey, Budget
from teams.models import Membership, Team

pytestmark = pytest.mark.django_db


@pytest.fixture
def org():
    """Team search with its member ana, who holds the key bot-1; bo, in no team."""
    search = Team.objects.create(name="search")
    ana, bo = User.objects.create_user("ana"), User.objects.create_user("bo")
    Membership.objects.create(team=search, user=ana)
    return {"search": search, "ana": ana, "bo": bo, "key": ApiKey.issue("bot-1", team=search, user=ana)[0]}


def add(admin_client, **data):
    fields = {"amount": "25", "window": "month", "timezone": "UTC", **data}
    return admin_client.post(reverse("admin:keys_budget_add"), fields, follow=True)


def test_a_members_budget_is_added_and_listed_with_whose_it_is(admin_client, org):
    response = add(admin_client, team=org["search"].pk, user=org["ana"].pk, soft_limit_percent="80")
    assert response.status_code == 200
    budget = Budget.objects.get()
    assert (budget.team, budget.user, budget.amount, budget.soft_limit_percent) == (
        org["search"],
        org["ana"],
        Decimal(25),
        80,
    )
    listed = admin_client.get(reverse("admin:keys_budget_changelist")).content.decode()
    assert "ana in team “search”" in listed and "25.000000" in listed


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (lambda org: {"team": org["search"].pk, "user": org["bo"].pk}, "bo is not a member of the team “search”."),
        (
            lambda org: {"team": org["search"].pk, "timezone": "Mars/Olympus"},
            "Unknown time zone “Mars/Olympus”: use a name like Europe/Paris.",
        ),
        (
            lambda org: {"team": org["search"].pk, "key": org["key"].pk},
            "A key&#x27;s budget names no team or user: the key&#x27;s own are counted apart.",
        ),
        (lambda org: {}, "A budget is a team&#x27;s, a member&#x27;s within a team, or a key&#x27;s: name one."),
    ],
    ids=["user-not-in-team", "unknown-timezone", "key-and-team", "no-scope"],
)
def test_a_budget_the_model_refuses_is_a_form_error_saying_why(admin_client, org, fields, message):
    assert message in add(admin_client, **fields(org)).content.decode()
    assert not Budget.objects.exists()


def test_budgets_are_searched_by_team_user_and_key_and_filtered_by_window(admin_client, org):
    Budget.objects.create(team=org["search"], amount=Decimal(100), window=Budget.Window.MONTH)
    Budget.objects.create(team=org["search"], user=org["ana"], amount=Decimal(10), window=Budget.Window.DAY)
    Budget.objects.create(key=org["key"], amount=Decimal(1), window=Budget.Window.NONE)
    url = reverse("admin:keys_budget_changelist")

    def shown(**query) -> int:
        return admin_client.get(url, query).context["cl"].result_count

    assert shown() == 3
    assert shown(q="search") == 2  # the team's, and ana's within it
    assert shown(q="ana") == 1
    assert shown(q="bot-1") == 1
    assert shown(window__exact="day") == 1
