"""A control plane stopped with SIGTERM closes its agent streams and exits at once; agents move to another.

Real processes: two control planes (uvicorn, one SQLite file) and an agent (`python -m agent`).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import free_port, wait_until

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent.parent


def _env(var_dir: Path) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")}
    return clean | {"LLMGW_HOME": str(var_dir), "PYTHONUNBUFFERED": "1", "LLMGW_HEARTBEAT_SECONDS": "0.5"}


def _control_plane(port: int, env: dict, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "uvicorn", "llmgw_site.asgi:application", "--port", str(port)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _serving(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_sigterm_closes_agent_streams_exits_within_5_s_and_the_agent_moves_on(tmp_path):
    env = _env(tmp_path)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True, timeout=120)
    token = subprocess.run(
        [sys.executable, "manage.py", "enrol_node", "n1"], cwd=ROOT, env=env, check=True, capture_output=True,
        text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    first_port, second_port = free_port(), free_port()
    first = _control_plane(first_port, env, tmp_path / "first.log")
    second = _control_plane(second_port, env, tmp_path / "second.log")
    for port in (first_port, second_port):  # both serving before the agent picks the first
        wait_until(lambda port=port: _serving(port), 30, 0.05, describe=lambda: (tmp_path / "first.log").read_text())
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent", "--node", "n1", "--token", token, "--fake-gpus", "1xH100-80GB",
         "--control-plane", f"ws://127.0.0.1:{first_port}/agent/ws",
         "--control-plane", f"ws://127.0.0.1:{second_port}/agent/ws"],
        cwd=ROOT, env=env, stdout=(tmp_path / "agent.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_until(
            lambda: "agent connected: n1" in (tmp_path / "first.log").read_text(),
            30,
            0.1,
            describe=lambda: (tmp_path / "agent.log").read_text(),
        )
        stopped_at = time.monotonic()
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=5)  # raises if it takes longer
        assert time.monotonic() - stopped_at <= 5
        assert "agent disconnected: n1 (code 1012)" in (tmp_path / "first.log").read_text()
        wait_until(
            lambda: "agent connected: n1" in (tmp_path / "second.log").read_text(),
            2,
            0.05,
            describe=lambda: (tmp_path / "agent.log").read_text(),
        )
    finally:
        for proc in (agent, first, second):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
