"""API keys in the admin: every scope, expiry and limit editable, scopes checked against the catalog,
last use read-only, and revoke/restore actions that say how soon routers follow."""

import datetime as dt
import re

import pytest
from django.urls import reverse
from django.utils import timezone

from catalog.models import Alias, Model
from keys.models import ApiKey

pytestmark = pytest.mark.django_db


@pytest.fixture
def catalog():
    llama = Model.objects.create(name="llama-3-8b", source="meta/llama")
    Alias.objects.create(model=llama, name="llama")
    Model.objects.create(name="qwen-7b", source="org/qwen")


def add(admin_client, **data):
    return admin_client.post(reverse("admin:keys_apikey_add"), {"name": "team-a", **data}, follow=True)


def change(admin_client, api_key, **data):
    fields = {"name": api_key.name, "active": "on", "allowed_models": "", "allowed_pools": "", **data}
    return admin_client.post(reverse("admin:keys_apikey_change", args=[api_key.pk]), fields, follow=True)


def test_a_key_is_added_with_its_scopes_expiry_and_limits(admin_client, catalog):
    response = add(
        admin_client,
        allowed_models="llama, qwen-7b, llama",
        allowed_pools="eu, spot",
        expires_at_0="2099-01-01",
        expires_at_1="00:00:00",
        rpm="60",
        tpm="10000",
    )
    assert re.search(r"sk-llmgw-[A-Za-z0-9_-]{20,}", response.content.decode())
    api_key = ApiKey.objects.get()
    assert api_key.allowed_models == ["llama", "qwen-7b"] and api_key.allowed_pools == ["eu", "spot"]
    assert (api_key.rpm, api_key.tpm) == (60, 10000) and api_key.expires_at.year == 2099


def test_an_unknown_model_in_the_scope_is_a_form_error_naming_it(admin_client, catalog):
    response = add(admin_client, allowed_models="llama, mistral, gpt-9")
    assert "Unknown models `mistral`, `gpt-9`" in response.content.decode()
    assert not ApiKey.objects.exists()


def test_with_an_empty_catalog_any_model_name_is_accepted(admin_client):
    add(admin_client, allowed_models="served-by-a-static-router")
    assert ApiKey.objects.get().allowed_models == ["served-by-a-static-router"]


@pytest.mark.parametrize("field", ["rpm", "tpm"])
def test_a_limit_below_one_is_a_form_error(admin_client, field):
    response = add(admin_client, **{field: "0"})
    assert "Ensure this value is greater than or equal to 1." in response.content.decode()
    assert not ApiKey.objects.exists()


def test_a_keys_scopes_are_shown_as_lists_and_edited(admin_client, catalog):
    api_key, _ = ApiKey.issue("team-a", allowed_models=["llama"], allowed_pools=["eu"])
    page = admin_client.get(reverse("admin:keys_apikey_change", args=[api_key.pk])).content.decode()
    assert 'value="llama"' in page and 'value="eu"' in page
    change(admin_client, api_key, allowed_models="qwen-7b, llama-3-8b", tpm="500")
    api_key.refresh_from_db()
    assert api_key.allowed_models == ["qwen-7b", "llama-3-8b"] and api_key.tpm == 500
    assert "Unknown model `nope`" in change(admin_client, api_key, allowed_models="nope").content.decode()


def test_last_use_is_shown_and_cannot_be_edited(admin_client):
    used_at = timezone.now() - dt.timedelta(minutes=5)
    api_key, _ = ApiKey.issue("team-a", last_used_at=used_at)
    page = admin_client.get(reverse("admin:keys_apikey_change", args=[api_key.pk])).content.decode()
    assert "Last used at" in page and 'name="last_used_at"' not in page
    change(admin_client, api_key, last_used_at="2000-01-01 00:00:00")
    api_key.refresh_from_db()
    assert api_key.last_used_at == used_at


def test_revoke_and_restore_actions_say_every_router_follows_within_a_second(admin_client):
    kept, _ = ApiKey.issue("kept")
    revoked, _ = ApiKey.issue("revoked")
    url = reverse("admin:keys_apikey_changelist")
    page = admin_client.post(url, {"action": "revoke", "_selected_action": [revoked.pk]}, follow=True)
    assert "Revoked 1 key(s): refused by every router within a second." in page.content.decode()
    assert list(ApiKey.objects.active().values_list("name", flat=True)) == ["kept"]
    page = admin_client.post(url, {"action": "restore", "_selected_action": [revoked.pk]}, follow=True)
    assert "Restored 1 key(s)" in page.content.decode()
    assert ApiKey.objects.active().count() == 2
