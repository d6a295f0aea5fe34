"""Settings come from the environment; bad values stop start-up with the variable's name."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from channels_redis.core import RedisChannelLayer
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string
from redis.asyncio import BlockingConnectionPool

from llmgw_site.env import env_bool, env_float, env_int, env_port, env_port_range
from llmgw_site.settings import channel_layers

ROOT = Path(__file__).resolve().parent.parent


def django_setup(**env) -> subprocess.CompletedProcess:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith("LLMGW_") and k not in ("DATABASE_URL", "SECRET_KEY")
    }
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import django, os; os.environ['DJANGO_SETTINGS_MODULE']='llmgw_site.settings'; django.setup()",
        ],
        cwd=ROOT,
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "reader, value, words",
    [
        (lambda: env_port("LLMGW_X", 1), "ten", "port 'ten' is not a number"),
        (lambda: env_port("LLMGW_X", 1), "0", "port 0 is outside 1-65535"),
        (lambda: env_float("LLMGW_X", 1.0, minimum=0.1), "nan", "must be a number"),
        (lambda: env_float("LLMGW_X", 1.0, minimum=0.1), "inf", "must be a finite number"),
        (lambda: env_bool("LLMGW_X"), "maybe", "not a boolean"),
        (lambda: env_int("LLMGW_X", 1, minimum=1), "2.5", "not a whole number"),
        (lambda: env_int("LLMGW_X", 1, minimum=1), "0", "at least 1"),
        (lambda: env_port_range("LLMGW_X", (1, 2)), "30000", "not a port range"),
        (lambda: env_port_range("LLMGW_X", (1, 2)), "300-20", "must satisfy"),
    ],
)
def test_bad_environment_values_name_the_variable(monkeypatch, reader, value, words):
    monkeypatch.setenv("LLMGW_X", value)
    with pytest.raises(ImproperlyConfigured, match=f"LLMGW_X.*{words}"):
        reader()


def test_good_environment_values_are_read(monkeypatch):
    monkeypatch.setenv("LLMGW_X", "20000-20010")
    assert env_port_range("LLMGW_X", (1, 2)) == (20000, 20010)
    monkeypatch.setenv("LLMGW_X", "9000")
    assert env_port("LLMGW_X", 1) == 9000
    monkeypatch.setenv("LLMGW_X", "off")
    assert env_bool("LLMGW_X", True) is False
    monkeypatch.setenv("LLMGW_X", " 12 ")
    assert env_int("LLMGW_X", 1, minimum=1) == 12


def test_start_up_fails_on_a_bad_tick_interval():
    result = django_setup(LLMGW_TICK_SECONDS="soon")
    assert result.returncode != 0
    assert "LLMGW_TICK_SECONDS='soon' is not a number" in result.stderr


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS", "-1", "must be a number of at least 0.0"),
        ("LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS", "a day", "is not a number"),
        ("LLMGW_WEIGHTS_SWEEP_SECONDS", "0", "must be a number of at least 1.0"),
        ("LLMGW_WEIGHTS_SWEEP_BATCH", "0", "must be a whole number of at least 1"),
    ],
)
def test_start_up_fails_on_a_bad_weights_sweep_setting(name, value, words):
    result = django_setup(**{name: value})
    assert result.returncode != 0
    assert f"{name}={value!r} {words}" in result.stderr


def test_start_up_fails_on_an_empty_llama_server_binary():
    result = django_setup(LLMGW_LLAMA_SERVER=" ")
    assert result.returncode != 0
    assert "LLMGW_LLAMA_SERVER must name the llama.cpp server binary" in result.stderr


def test_start_up_fails_on_a_traces_exporter_llmgw_does_not_ship():
    result = django_setup(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4317", OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    assert result.returncode != 0
    assert "OTEL_EXPORTER_OTLP_PROTOCOL='grpc': llmgw exports OTLP over http/protobuf only" in result.stderr


def test_the_host_up_listens_on_is_an_allowed_host():
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import django, os; os.environ['DJANGO_SETTINGS_MODULE']='llmgw_site.settings'; "
            "django.setup(); from django.conf import settings; print(settings.ALLOWED_HOSTS)",
        ],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("LLMGW_") and k != "ALLOWED_HOSTS"}
        | {"LLMGW_HOST": "10.1.2.3", "LLMGW_HOME": os.environ.get("LLMGW_HOME", str(ROOT / "var"))},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "'10.1.2.3'" in result.stdout and "'localhost'" in result.stdout


def test_a_database_url_without_a_secret_key_is_refused():
    result = django_setup(DATABASE_URL="postgres://postgres@127.0.0.1:5432/test")
    assert result.returncode != 0
    assert "SECRET_KEY must be set when DATABASE_URL is set" in result.stderr


def test_embedded_mode_uses_the_in_memory_channel_layer():
    assert channel_layers(None)["default"]["BACKEND"] == "channels.layers.InMemoryChannelLayer"


def test_redis_channel_layer_reads_outlast_its_blocking_receive(redis_url):
    """A socket timeout at or below BZPOPMIN's block would drop every idle agent stream."""
    layers = channel_layers(redis_url)["default"]
    layer = import_string(layers["BACKEND"])(**layers["CONFIG"])
    assert isinstance(layer, RedisChannelLayer)
    pool = layer.create_pool(0)
    assert pool.connection_kwargs["socket_timeout"] > layer.brpop_timeout
    # A burst waits for a free connection rather than failing (agent handshakes answered 500).
    assert isinstance(pool, BlockingConnectionPool) and pool.timeout == layer.pool_timeout > 0

    async def round_trip():
        channel = await layer.new_channel()
        await layer.send(channel, {"type": "agent.command", "n": 1})
        message = await layer.receive(channel)
        await layer.flush()
        return message

    assert async_to_sync(round_trip)() == {"type": "agent.command", "n": 1}


def test_kept_database_connections_are_checked_before_reuse():
    result = subprocess.run(
        [sys.executable, "-c", "import django, os; os.environ['DJANGO_SETTINGS_MODULE']='llmgw_site.settings'; "
         "django.setup(); from django.conf import settings; d = settings.DATABASES['default']; "
         "print(d['CONN_MAX_AGE'], d['CONN_HEALTH_CHECKS'])"],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        | {"DATABASE_URL": "postgres://postgres@127.0.0.1:5432/test", "SECRET_KEY": "test-only"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["60", "True"]


def test_the_old_name_of_llmgw_home_stops_the_start_naming_the_new_one():
    result = django_setup(LLMGW_VAR_DIR="/srv/llmgw")
    assert result.returncode != 0
    assert "LLMGW_VAR_DIR was renamed LLMGW_HOME: set LLMGW_HOME=/srv/llmgw and unset LLMGW_VAR_DIR" in result.stderr
