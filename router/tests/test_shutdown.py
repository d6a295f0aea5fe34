"""SIGTERM drains a real router process: no new requests, streams in flight finish (within the grace), then exit."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import pytest
from django.db import connection

from conftest import REDIS_TEST_URL, free_port, wait_until
from hub import RedisHub
from router.tests.conftest import MODEL, PROJECT, make_table

pytestmark = pytest.mark.django_db(transaction=True)


def database_env(tmp_path) -> dict[str, str]:
    """Environment that points a child process at the test's database (a copy, for SQLite)."""
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        var_dir = tmp_path / "var"
        var_dir.mkdir()
        source, target = sqlite3.connect(db["NAME"]), sqlite3.connect(var_dir / "llmgw.sqlite3")
        source.backup(target)
        source.close()
        target.close()
        return {"LLMGW_HOME": str(var_dir)}
    url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    return {"DATABASE_URL": url, "LLMGW_HOME": str(tmp_path)}


@pytest.fixture
def slow_engine():
    """The bundled mock engine, 100 ms per token (a stream of ~10 tokens takes about a second)."""
    port = free_port()
    argv = [sys.executable, "-m", "mockengine", "--port", str(port), "--model", MODEL, "--token-delay-ms", "100"]
    process = subprocess.Popen(argv, cwd=PROJECT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def answers():
        try:
            return httpx.get(f"{url}/health", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(answers, timeout=10, interval=0.05)
    yield url
    process.kill()
    process.wait(5)


@pytest.fixture
def router_process(tmp_path, redis_url, api_key):
    """Start `python -m router.asgi` on the test's database and Redis hub; yields a starter."""
    started: list[subprocess.Popen] = []

    def start(grace: float) -> tuple[subprocess.Popen, str]:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        env |= database_env(tmp_path) | {
            "REDIS_URL": REDIS_TEST_URL,
            "LLMGW_SHUTDOWN_GRACE_SECONDS": str(grace),
            "LLMGW_ROUTER_POLL_SECONDS": "0.2",
            "SECRET_KEY": env.get("SECRET_KEY", "test-only"),
        }
        argv = [sys.executable, "-m", "router.asgi", "--host", "127.0.0.1", "--port", str(port)]
        with open(tmp_path / f"router-{port}.log", "w") as log:
            process = subprocess.Popen(argv, cwd=PROJECT, env=env, stdout=log, stderr=subprocess.STDOUT)
        started.append(process)
        url = f"http://127.0.0.1:{port}"

        def serves():
            assert process.poll() is None, (tmp_path / f"router-{port}.log").read_text()
            try:
                return httpx.get(f"{url}/health", timeout=0.5).json()["endpoints"] == 1
            except httpx.HTTPError:
                return False

        wait_until(serves, timeout=15, interval=0.1)
        return process, url

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(5)


def stream_in_background(url: str, key: str, first_chunk: threading.Event) -> list:
    """Start a streaming chat in a thread; the list gets its lines and finally 'closed' or the exception."""
    outcome: list = []

    def run():
        body = {"model": MODEL, "messages": [{"role": "user", "content": "one two three four five"}], "stream": True}
        try:
            with httpx.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10
            ) as response:
                for line in response.iter_lines():
                    if line:
                        outcome.append(line)
                        first_chunk.set()
            outcome.append("closed")
        except httpx.HTTPError as exc:
            outcome.append(exc)
            first_chunk.set()

    threading.Thread(target=run, daemon=True).start()
    return outcome


def test_sigterm_refuses_new_requests_lets_the_stream_finish_then_exits(router_process, slow_engine, api_key, tmp_path):
    RedisHub(REDIS_TEST_URL).publish_endpoints(make_table([slow_engine]))
    process, url = router_process(grace=10)
    first_chunk = threading.Event()
    lines = stream_in_background(url, api_key, first_chunk)
    assert first_chunk.wait(5)

    process.send_signal(signal.SIGTERM)
    # New connections are refused at once while the stream carries on.
    wait_until(lambda: refused(url), timeout=3)
    assert process.poll() is None
    # Past the 10 s grace uvicorn would cut the stream, which the lines below would show; the wait only
    # allows for a slow machine (a loaded CI runner has taken more than 8 s to see the exit).
    exit_within(process, 20, tmp_path)
    # uvicorn re-raises the signal once it has shut down, so the exit status says what stopped it.
    assert process.returncode == -signal.SIGTERM
    assert lines[-2:] == ["data: [DONE]", "closed"]
    assert sum(line.startswith("data: {") for line in lines) >= 9  # every token arrived


def test_past_the_grace_period_the_router_exits_and_the_stream_is_cut(router_process, slow_engine, api_key, tmp_path):
    RedisHub(REDIS_TEST_URL).publish_endpoints(make_table([slow_engine]))
    process, url = router_process(grace=0.3)
    first_chunk = threading.Event()
    lines = stream_in_background(url, api_key, first_chunk)
    assert first_chunk.wait(5)
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    exit_within(process, 5, tmp_path)
    assert time.monotonic() - started < 3  # the stream alone would take about a second more
    wait_until(lambda: lines[-1] == "closed" or isinstance(lines[-1], Exception), timeout=5)
    assert "data: [DONE]" not in lines


def refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=0.5)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def exit_within(process: subprocess.Popen, seconds: float, tmp_path) -> None:
    """Wait for the router process to exit; fail with its log if it does not."""
    try:
        process.wait(seconds)
    except subprocess.TimeoutExpired:
        logs = "".join(path.read_text() for path in tmp_path.glob("router-*.log"))
        raise AssertionError(f"the router did not exit within {seconds} s; its log:\n{logs}") from None
