"""`manage.py up --demo` as a real process for end-to-end tests, and `ctl_status --json` against it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from conftest import engine_port_range, free_port

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-llmgw-e2e-test-key-0123456789"


def engine_pids(var_dir: Path, program: bytes = b"mockengine") -> set[int]:
    """Engine processes (the mock, or those with `program` as an argument) started for this test's `up`.

    They are found by their environment, which the agent passes on to them.
    """
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if program in cmdline and f"LLMGW_HOME={var_dir}".encode() in environ:
            pids.add(int(entry.name))
    return pids


@contextmanager
def demo_stack(var_dir: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[dict]:
    """Run `up --demo *args` on a SQLite file in `var_dir` until the router serves; kill it afterwards."""
    port, router_port = free_port(), free_port()
    full_env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")} | {
        "LLMGW_HOME": str(var_dir),
        "LLMGW_DEMO_API_KEY": API_KEY,
        "LLMGW_DEMO_ADMIN_PASSWORD": "e2e-admin-password",
        "LLMGW_PORT": str(port),
        "LLMGW_ROUTER_PORT": str(router_port),
        "LLMGW_TICK_SECONDS": "0.5",
        "LLMGW_ENGINE_PORT_RANGE": engine_port_range(0),
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    log_path = var_dir / "up.log"
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "up", "--demo", *args],
            cwd=ROOT,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{router_port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200 and "API key" in log_path.read_text():
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("up --demo did not serve within 60 s:\n" + log_path.read_text())
        try:
            yield {"proc": proc, "env": full_env, "router": base, "port": port, "var": var_dir, "log": log_path}
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


# Eviction within seconds, for end-to-end tests of swaps and making room.
QUICK_EVICTION = {
    "LLMGW_EVICT_MIN_IDLE_SECONDS": "1",
    "LLMGW_MIN_RESIDENCY_SECONDS": "1",
    "LLMGW_HEARTBEAT_SECONDS": "1",
}


@contextmanager
def catalog_stack(var_dir: Path, catalog: str, env: dict[str, str] | None = None) -> Iterator[dict]:
    """`demo_stack` on the catalog file `catalog` (YAML text), written into `var_dir`."""
    path = var_dir / "catalog.yaml"
    path.write_text(catalog)
    with demo_stack(var_dir, "--catalog", str(path), env=env) as stack:
        yield stack


def chat(client, model: str, content: str = "hello") -> str:
    """One chat completion through the router with the `openai` client `client`; the answer's text."""
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}])
    return reply.choices[0].message.content


def ctl_status(env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "manage.py", "ctl_status", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
