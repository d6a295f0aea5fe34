"""The key tables move from the router app to the keys app with their rows: a database migrated before
the move (router 0002) migrates on with every key, scope, limit and usage row, and the permissions granted
on keys keep their content types."""

import datetime as dt

import pytest
from django.contrib.auth.models import Group, Permission
from django.contrib.contenttypes.models import ContentType
from django.utils import timezone

from conftest import migrate_to
from hub.credentials import hash_secret
from keys.models import ApiKey, TokenUsage

BEFORE = [("router", "0002_key_scopes_limits_and_token_usage"), ("keys", None)]


@pytest.fixture
def before_the_move(transactional_db):
    """The schema as router 0002 left it; the latest schema again afterwards, as Django's own migration tests do."""
    yield migrate_to(BEFORE)
    migrate_to()


def test_keys_and_their_usage_survive_the_move_to_the_keys_app(before_the_move):
    registry = before_the_move
    old_key = registry.get_model("router", "ApiKey")
    old_usage = registry.get_model("router", "TokenUsage")
    expires = timezone.now() + dt.timedelta(days=30)
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    written = old_key.objects.create(
        name="team-a",
        prefix="sk-llmgw-abcdef",
        key_hash=hash_secret("sk-llmgw-abcdef-secret"),
        allowed_models=["llama"],
        allowed_pools=["eu"],
        expires_at=expires,
        rpm=60,
        tpm=1000,
    )
    old_usage.objects.create(key=written, key_name="team-a", model="llama", hour=hour, requests=2, prompt_tokens=5)
    router_key_type = ContentType.objects.get_or_create(app_label="router", model="apikey")[0]
    revoker = Permission.objects.get_or_create(
        content_type=router_key_type, codename="change_apikey", defaults={"name": "Can change API key"}
    )[0]
    Group.objects.create(name="key admins").permissions.add(revoker)

    migrate_to()

    api_key = ApiKey.objects.get()
    assert (api_key.pk, api_key.name, api_key.key_hash) == (written.pk, "team-a", hash_secret("sk-llmgw-abcdef-secret"))
    assert (api_key.allowed_models, api_key.allowed_pools) == (["llama"], ["eu"])
    assert (api_key.expires_at, api_key.rpm, api_key.tpm) == (expires, 60, 1000)
    usage = TokenUsage.objects.get()
    assert (usage.key, usage.model, usage.hour, usage.requests, usage.prompt_tokens) == (api_key, "llama", hour, 2, 5)
    assert list(api_key.token_usage.all()) == [usage]
    assert ApiKey._meta.db_table == "keys_apikey" and TokenUsage._meta.db_table == "keys_tokenusage"
    assert not ContentType.objects.filter(app_label="router").exists()
    granted = Group.objects.get(name="key admins").permissions.get()
    assert granted.pk == revoker.pk and granted.content_type.app_label == "keys"
    assert granted.content_type.model_class() is ApiKey


def test_the_move_runs_backwards_to_the_router_tables(before_the_move):
    registry = before_the_move
    migrate_to()
    ApiKey.issue("kept")
    migrate_to(BEFORE)
    assert [key.name for key in registry.get_model("router", "ApiKey").objects.all()] == ["kept"]
    assert ContentType.objects.filter(app_label="router", model="apikey").exists()
