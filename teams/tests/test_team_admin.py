"""Teams in the admin: a team is made with its members and roles, its models checked against the catalog, and
a key of the team is added through the key's form only within the team's bounds."""

import re

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

from catalog.models import Model
from keys.models import ApiKey
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
    return admin_client.post(reverse("admin:teams_team_add"), {**members, **data}, follow=True)


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
