"""The demo's admin password and API key survive a restart: kept under the var dir (0600), reused,
overridden by the environment, and a damaged file is named and changes nothing."""

import json
import stat

import pytest
from django.contrib.auth import authenticate, get_user_model
from django.core.management import CommandError, call_command

from hub.credentials import hash_secret
from keys.models import ApiKey
from runner.demo import DEMO_KEY_NAME, DemoCredentialsError, create_demo_fleet
from runner.management.commands.up import Command

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def var_dir(settings, tmp_path, monkeypatch):
    monkeypatch.delenv("LLMGW_DEMO_ADMIN_PASSWORD", raising=False)
    monkeypatch.delenv("LLMGW_DEMO_API_KEY", raising=False)
    settings.VAR_DIR = tmp_path
    return tmp_path


def test_the_first_runs_credentials_are_kept_and_reused(var_dir):
    first = create_demo_fleet()
    kept = var_dir / "demo-credentials.json"
    assert first.credentials == "new"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert json.loads(kept.read_text()) == {"admin_password": first.admin_password, "api_key": first.api_key}

    second = create_demo_fleet()
    assert second.credentials == "reused"
    assert (second.admin_password, second.api_key) == (first.admin_password, first.api_key)
    assert authenticate(username="admin", password=first.admin_password) is not None
    # The same row, still active: its usage history is kept.
    assert list(ApiKey.objects.filter(name=DEMO_KEY_NAME).values_list("key_hash", "active")) == [
        (hash_secret(first.api_key), True)
    ]


def test_the_environment_overrides_the_kept_credentials(var_dir, monkeypatch):
    first = create_demo_fleet()
    monkeypatch.setenv("LLMGW_DEMO_ADMIN_PASSWORD", "pw-from-env")
    monkeypatch.setenv("LLMGW_DEMO_API_KEY", "sk-llmgw-from-env")
    second = create_demo_fleet()
    assert (second.admin_password, second.api_key, second.credentials) == (
        "pw-from-env",
        "sk-llmgw-from-env",
        "from the environment",
    )
    assert authenticate(username="admin", password="pw-from-env") is not None
    assert list(ApiKey.objects.filter(name=DEMO_KEY_NAME).values_list("key_hash", flat=True)) == [
        hash_secret("sk-llmgw-from-env")
    ]
    # The kept file is untouched: without the variables, the first run's credentials come back.
    monkeypatch.delenv("LLMGW_DEMO_ADMIN_PASSWORD")
    monkeypatch.delenv("LLMGW_DEMO_API_KEY")
    assert create_demo_fleet().api_key == first.api_key


def test_a_damaged_credentials_file_is_named_and_changes_nothing(var_dir):
    kept = var_dir / "demo-credentials.json"
    kept.write_text("{not json")
    with pytest.raises(DemoCredentialsError, match=f"{kept}: cannot reuse the demo credentials .*delete the file"):
        create_demo_fleet()
    assert not get_user_model().objects.exists() and not ApiKey.objects.exists()
    assert kept.read_text() == "{not json"


def test_the_banner_says_whether_the_credentials_are_new(var_dir, monkeypatch):
    kept = var_dir / "demo-credentials.json"
    assert Command()._credentials_text(create_demo_fleet()) == f"new (kept in {kept}; the next run reuses them)"
    assert Command()._credentials_text(create_demo_fleet()) == f"reused from {kept} (delete it for new ones)"
    monkeypatch.setenv("LLMGW_DEMO_API_KEY", "sk-llmgw-from-env")
    assert "LLMGW_DEMO_API_KEY" in Command()._credentials_text(create_demo_fleet())


def test_up_refuses_to_start_on_a_damaged_credentials_file(var_dir):
    (var_dir / "demo-credentials.json").write_text('{"admin_password": 1}')
    with pytest.raises(CommandError, match="nothing started: .*expected an object with the strings"):
        call_command("up", "--demo")
    assert not ApiKey.objects.exists()
