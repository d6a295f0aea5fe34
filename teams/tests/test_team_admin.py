"""Teams in the admin: a team is made with its members and roles, its models checked against the catalog, a key
of the team is added through the key's form only within the team's bounds, and a team's page, once the team is
saved, sets its budget and its members' (a member's only for someone in the team)."""

import re
from decimal import Decimal

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

from catalog.models import Model
from keys.models import ApiKey, Budget
from teams.models import Membership, Team

pytestmark = pytest.mark.django_db


@pytest.fixture
def catalog():
    Model.objects.create(name="llama-3-8b", source="meta/llama")
    Model.objects.create(name="qwen-7b", source="org/qwen")


def add_team(admin_client, **data):
    members = {
        "memberships-TOTAL_FORMS": "1",
        "memberships-INITIAL_FORMS": "0",
        "memberships-MIN_NUM_FORMS": "0",
        "memberships-MAX_NUM_FORMS": "1000",
    }
    shares = {"weight": "1", "priority_class": "standard"}  # the form's defaults, as a browser posts them
    return admin_client.post(reverse("admin:teams_team_add"), {**members, **shares, **data}, follow=True)


def test_a_team_is_added_with_a_member_and_its_role(admin_client, catalog):
    ana = User.objects.create_user("ana")
    response = add_team(
        admin_client,
        name="search",
        allowed_models="llama-3-8b, qwen-7b",
        **{"memberships-0-user": str(ana.pk), "memberships-0-role": "admin"},
    )
    assert response.status_code == 200
    team = Team.objects.get()
    assert team.allowed_models == ["llama-3-8b", "qwen-7b"]
    assert list(Membership.objects.values_list("user__username", "role")) == [("ana", "admin")]


def test_a_teams_weight_and_class_are_set_in_its_form_and_a_weight_out_of_range_is_refused(admin_client, catalog):
    ana = User.objects.create_user("ana")
    member = {"memberships-0-user": str(ana.pk), "memberships-0-role": "admin"}
    add_team(admin_client, name="batchy", weight="3", priority_class="batch", **member)
    team = Team.objects.get()
    assert (team.weight, team.priority_class) == (3, "batch")
    response = add_team(admin_client, name="greedy", weight="1001", **member)
    assert "Ensure this value is less than or equal to 1000." in response.content.decode()
    assert not Team.objects.filter(name="greedy").exists()


def test_a_team_naming_a_model_the_catalog_lacks_is_a_form_error_naming_it(admin_client, catalog):
    response = add_team(admin_client, name="search", allowed_models="llama-3-8b, gpt-9")
    assert "Unknown model `gpt-9`" in response.content.decode()
    assert not Team.objects.exists()


def test_a_key_of_the_team_is_added_within_its_bounds_only(admin_client, catalog):
    team = Team.objects.create(name="search", allowed_models=["llama-3-8b"])
    ana = User.objects.create_user("ana")
    Membership.objects.create(team=team, user=ana)
    url = reverse("admin:keys_apikey_add")

    wider = admin_client.post(url, {"name": "k", "team": team.pk, "user": ana.pk, "allowed_models": "qwen-7b"})
    assert "may not use `qwen-7b`" in wider.content.decode() and not ApiKey.objects.exists()

    added = admin_client.post(url, {"name": "k", "team": team.pk, "user": ana.pk}, follow=True)
    assert re.search(r"sk-llmgw-[A-Za-z0-9_-]{20,}", added.content.decode())
    key = ApiKey.objects.get()
    assert (key.team, key.user, key.allowed_models) == (team, ana, [])


def change_team(admin_client, team, *, budget_user):
    """Post the team's page as it is, with one new budget row for `budget_user`."""
    ana = team.memberships.get()
    return admin_client.post(
        reverse("admin:teams_team_change", args=[team.pk]),
        {
            "name": team.name,
            "allowed_models": "",
            "weight": str(team.weight),
            "priority_class": team.priority_class,
            "memberships-TOTAL_FORMS": "1",
            "memberships-INITIAL_FORMS": "1",
            "memberships-MIN_NUM_FORMS": "0",
            "memberships-MAX_NUM_FORMS": "1000",
            "memberships-0-id": str(ana.pk),
            "memberships-0-team": str(team.pk),
            "memberships-0-user": str(ana.user_id),
            "memberships-0-role": ana.role,
            "budgets-TOTAL_FORMS": "1",
            "budgets-INITIAL_FORMS": "0",
            "budgets-MIN_NUM_FORMS": "0",
            "budgets-MAX_NUM_FORMS": "1000",
            "budgets-0-user": str(budget_user.pk),
            "budgets-0-amount": "12.5",
            "budgets-0-window": "week",
            "budgets-0-timezone": "Europe/Paris",
        },
        follow=True,
    )


def test_a_teams_page_sets_a_members_budget_and_refuses_one_for_someone_outside_it(admin_client):
    team = Team.objects.create(name="search")
    ana, bo = User.objects.create_user("ana"), User.objects.create_user("bo")
    Membership.objects.create(team=team, user=ana)
    refused = change_team(admin_client, team, budget_user=bo).content.decode()
    assert "bo is not a member of the team “search”." in refused
    assert not Budget.objects.exists()

    change_team(admin_client, team, budget_user=ana)
    budget = Budget.objects.get()
    assert (budget.team, budget.user, budget.amount, budget.window) == (team, ana, Decimal("12.5"), "week")


def test_a_new_team_is_saved_before_its_budgets_are_set(admin_client):
    page = admin_client.get(reverse("admin:teams_team_add")).content.decode()
    assert "memberships-TOTAL_FORMS" in page and "budgets-TOTAL_FORMS" not in page
