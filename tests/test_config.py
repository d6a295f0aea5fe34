"""The settings registry: settings.py reads every variable through it, and docs/configuration.md's table is printed
from it."""

import ast
import json
import os
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command

from llmgw_site.config import REGISTRY, markdown_table, setting, shown_default
from llmgw_site.env import env_list

ROOT = Path(__file__).resolve().parent.parent
SETTINGS_PY = ROOT / "llmgw_site" / "settings.py"
ENV_READERS = {"env_str", "env_bool", "env_float", "env_int", "env_port", "env_port_range", "env_list", "getenv"}


def settings_calls() -> tuple[list[str], list[str]]:
    """(names read with setting("NAME"), readers called around the registry) in settings.py."""
    read, around = [], []
    for node in ast.walk(ast.parse(SETTINGS_PY.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name == "setting":
                read.append(node.args[0].value)  # type: ignore[attr-defined]
            elif name in ENV_READERS:
                around.append(ast.unparse(node))
        if isinstance(node, ast.Attribute) and node.attr == "environ":
            around.append(ast.unparse(node))
    return read, around


def test_settings_py_reads_the_environment_only_through_the_registry():
    read, around = settings_calls()
    assert around == []
    assert sorted(set(read)) == sorted(REGISTRY), "every registered setting is read, and only registered ones"
    assert len(read) == len(set(read)), "each variable is read once"


def test_the_configuration_pages_table_is_the_generated_one():
    readme = (ROOT / "docs" / "configuration.md").read_text()
    table = markdown_table()
    assert table in readme, (
        "docs/configuration.md is out of date: paste `python manage.py settings_table` under Configuration"
    )
    start = readme.index("| variable | default | meaning |")
    assert readme[start:].split("\n\n", 1)[0] + "\n" == table, "docs/configuration.md has rows the registry does not"


def test_settings_table_command_prints_every_setting_with_its_default():
    out = StringIO()
    call_command("settings_table", stdout=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 + len(REGISTRY)
    assert "| `LLMGW_TICK_SECONDS` | `2` | reconcile interval (beat schedule too) |" in lines
    assert "| `LLMGW_ENGINE_PORT_RANGE` | `20000-29999` | ports given to engines |" in lines
    assert any(line.startswith("| `LLMGW_METRICS_TOKEN` | unset |") for line in lines)


def test_shown_defaults():
    assert shown_default(REGISTRY["DEBUG"]) == "`0`"
    assert shown_default(REGISTRY["LLMGW_KV_CACHE_FULL_FRACTION"]) == "`0.95`"
    assert shown_default(REGISTRY["LLMGW_ALLOWED_HOSTS"]) == "unset"


def test_env_list_strips_items_and_drops_empty_ones(monkeypatch):
    monkeypatch.setenv("LLMGW_X", " a.example.com, ,.internal,")
    assert env_list("LLMGW_X") == ["a.example.com", ".internal"]
    monkeypatch.delenv("LLMGW_X")
    assert env_list("LLMGW_X", ["d"]) == ["d"]


def test_an_unregistered_name_cannot_be_read():
    with pytest.raises(KeyError):
        setting("LLMGW_NOT_A_SETTING")


def test_a_registered_setting_keeps_its_strict_reader(monkeypatch):
    from django.core.exceptions import ImproperlyConfigured

    monkeypatch.setenv("LLMGW_PREFIX_AFFINITY_SLACK", "-1")
    with pytest.raises(
        ImproperlyConfigured, match="LLMGW_PREFIX_AFFINITY_SLACK='-1' must be a whole number of at least 0"
    ):
        setting("LLMGW_PREFIX_AFFINITY_SLACK")


def deployed_settings(**env) -> dict:
    """ALLOWED_HOSTS, CSRF_TRUSTED_ORIGINS and LLMGW_METRICS_TOKEN of a real start-up with `env`."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("LLMGW_") and k not in ("ALLOWED_HOSTS", "CSRF_TRUSTED_ORIGINS")
    }
    code = (
        "import django, json, os; os.environ['DJANGO_SETTINGS_MODULE']='llmgw_site.settings'; django.setup(); "
        "from django.conf import settings as s; "
        "print(json.dumps([s.ALLOWED_HOSTS, s.CSRF_TRUSTED_ORIGINS, s.LLMGW_METRICS_TOKEN]))"
    )
    env = clean | {"LLMGW_HOME": os.environ.get("LLMGW_HOME", str(ROOT / "var"))} | env
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    hosts, origins, token = json.loads(result.stdout)
    return {"hosts": hosts, "origins": origins, "token": token}


def test_deployment_hosts_and_origins_add_to_the_defaults_and_to_djangos_own_variables():
    got = deployed_settings(
        LLMGW_ALLOWED_HOSTS="llmgw.example.com, .internal",
        LLMGW_CSRF_TRUSTED_ORIGINS="https://llmgw.example.com",
        LLMGW_METRICS_TOKEN="s3cret",
    )
    assert got["hosts"] == ["127.0.0.1", "localhost", "[::1]", "127.0.0.1", "llmgw.example.com", ".internal"]
    assert got["origins"] == ["https://llmgw.example.com"]
    assert got["token"] == "s3cret"
    got = deployed_settings(
        ALLOWED_HOSTS="a.example.com",
        LLMGW_ALLOWED_HOSTS="b.example.com",
        CSRF_TRUSTED_ORIGINS="https://a.example.com",
        LLMGW_CSRF_TRUSTED_ORIGINS="https://b.example.com",
    )
    assert got["hosts"] == ["a.example.com", "b.example.com"]
    assert got["origins"] == ["https://a.example.com", "https://b.example.com"]
    assert got["token"] == ""
