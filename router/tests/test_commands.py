"""`manage.py router`: bad arguments named, and router-only mode as a real process in front of the bundled
mock engine."""

import os
import re
import signal
import subprocess
import sys

import httpx
import pytest
from django.core.management import CommandError, call_command

from conftest import free_port, wait_until
from router.static_table import NO_CONTROL_PLANE

from .conftest import MODEL, PROJECT

IMPORTED = "sk-old-gateway-0123456789abcdef"


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--endpoint", "llama"], "--endpoint 'llama': expected MODEL=URL"),
        (["--endpoint", "llama=ftp://host/"], "--endpoint 'llama=ftp://host/': 'ftp://host/' is not an http"),
        (["--endpoint", "a=http://h:1", "--alias", "a=a"], "--alias 'a=a': alias 'a' is the name of a model"),
        (["--alias", "x=a"], "no endpoint given"),
        (["--endpoints", "/nonexistent/endpoints.yaml"], "--endpoints /nonexistent/endpoints.yaml: cannot read it"),
    ],
)
def test_router_refuses_bad_endpoints_naming_the_value(args, problem):
    with pytest.raises(CommandError, match=re.escape(problem)):
        call_command("router", *args)


@pytest.mark.parametrize(("args", "problem"), [(["--workers", "0"], "--workers 0"), (["--port", "70000"], "--port")])
def test_router_refuses_bad_workers_and_ports(args, problem):
    with pytest.raises(CommandError, match=problem):
        call_command("router", *args)


def test_router_only_mode_serves_engines_on_a_fixed_table_with_no_control_plane(tmp_path, engine_process):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env["LLMGW_VAR_DIR"] = str(tmp_path)  # a SQLite key store of its own
    manage = [sys.executable, "manage.py"]

    def run(*args):
        return subprocess.run([*manage, *args], cwd=PROJECT, env=env, capture_output=True, text=True, timeout=120)

    assert run("migrate", "--verbosity", "0").returncode == 0
    created = run("create_api_key", "ci", "--key", IMPORTED, "--models", MODEL)
    assert created.returncode == 0, created.stderr
    engine = engine_process()
    port = free_port()
    router = subprocess.Popen(
        [*manage, "router", "--port", str(port), "--endpoint", f"{MODEL}={engine.url}"],
        cwd=PROJECT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {IMPORTED}"}
    try:

        def up():
            assert router.poll() is None, router.stdout.read()
            try:
                return httpx.get(f"{url}/health", timeout=0.5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=30, interval=0.1)
        listed = httpx.get(f"{url}/v1/models", headers=auth).json()
        assert [m["id"] for m in listed["data"]] == [MODEL]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        answer = httpx.post(f"{url}/v1/chat/completions", headers=auth, json=body, timeout=10)
        assert answer.status_code == 200 and answer.json()["choices"]
        assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 401

        # No control plane to start another: a dead engine is said at once, not waited for.
        engine.kill()
        refused = httpx.post(f"{url}/v1/chat/completions", headers=auth, json=body, timeout=10)
        assert refused.status_code == 503
        assert NO_CONTROL_PLANE in refused.json()["error"]["message"]
    finally:
        router.send_signal(signal.SIGTERM)
        output = router.communicate(timeout=15)[0]
    # It drains, shuts down cleanly, then re-raises the signal it caught (so a supervisor sees why it ended).
    assert router.returncode in (0, -signal.SIGTERM) and "router draining" in output, output
    assert f"router-only mode, no control plane: {MODEL} → {engine.url}" in output
