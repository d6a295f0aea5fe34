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
from router.endpoints.static import NO_CONTROL_PLANE
from router.tests.conftest import MODEL, PROJECT

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
    env["LLMGW_HOME"] = str(tmp_path)  # a SQLite key store of its own
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


ENDPOINTS_FILE = """
models:
  {model}:
    aliases: [chat]
    endpoints:
      - url: {first}
        api_key_env: ENGINE_ONE_KEY
      - url: {second}
        api_key: sk-engine-two
"""


def test_router_only_mode_from_a_file_fronts_engines_with_keys_of_their_own(tmp_path, engine_process):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env["LLMGW_HOME"] = str(tmp_path)
    env["ENGINE_ONE_KEY"] = "sk-engine-one"
    manage = [sys.executable, "manage.py"]
    assert subprocess.run([*manage, "migrate", "--verbosity", "0"], cwd=PROJECT, env=env).returncode == 0
    created = subprocess.run(
        [*manage, "create_api_key", "ci", "--key", IMPORTED], cwd=PROJECT, env=env, capture_output=True, text=True
    )
    assert created.returncode == 0, created.stderr
    engines = [engine_process(api_key="sk-engine-one"), engine_process(api_key="sk-engine-two")]
    path = tmp_path / "endpoints.yaml"
    path.write_text(ENDPOINTS_FILE.format(model=MODEL, first=engines[0].url, second=engines[1].url))
    port = free_port()
    argv = [*manage, "router", "--port", str(port), "--workers", "2", "--endpoints", str(path)]
    router = subprocess.Popen(argv, cwd=PROJECT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {IMPORTED}"}
    try:
        wait_until(lambda: answers(router, url), timeout=30, interval=0.1)
        # The engines refuse anyone without their key; through the router, each gets its own.
        assert httpx.post(f"{engines[0].url}/v1/chat/completions", json={}).status_code == 401
        replicas = set()
        for i in range(16):
            body = {"model": "chat", "messages": [{"role": "user", "content": f"question {i}"}]}
            answer = httpx.post(f"{url}/v1/chat/completions", headers=auth, json=body, timeout=10)
            assert answer.status_code == 200, answer.text
            replicas.add(answer.headers["x-llmgw-replica"])
        assert replicas == {"static-1", "static-2"}
        # No key on any command line (ps shows them): the workers got the table in their environment.
        assert "sk-engine" not in " ".join(argv)
    finally:
        router.send_signal(signal.SIGTERM)
        output = router.communicate(timeout=20)[0]
    assert "sk-engine" not in output, output
    assert f"{MODEL} (alias chat) → {engines[0].url} [api key ***], {engines[1].url} [api key ***]" in output
    assert "REDIS_URL is not set, so each of the 2 workers keeps its own rate limits" in output


def answers(router: subprocess.Popen, url: str) -> bool:
    assert router.poll() is None, router.stdout.read() if router.stdout else ""
    try:
        return httpx.get(f"{url}/health", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False
