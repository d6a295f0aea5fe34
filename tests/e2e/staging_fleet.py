"""A fleet for staged weights, real processes: the mock hub, `manage.py up`, and agents with weights roots and
weights servers, each on its own fake GPUs; shared by the end-to-end test and bench/staging_bench.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from conftest import engine_port_range, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Fleet:
    """What a started fleet offers: its environment (for manage.py), router, key, hub and nodes."""

    env: dict[str, str]
    router: str
    key: str
    hub: str
    var: Path
    roots: dict[str, Path] = field(default_factory=dict)
    agents: dict[str, subprocess.Popen] = field(default_factory=dict)
    agent_argv: dict[str, list[str]] = field(default_factory=dict)

    def manage(self, *args: str, timeout: float = 120) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def status(self) -> dict:
        return json.loads(self.manage("ctl_status", "--json"))

    def apply(self, catalog: str) -> None:
        path = self.var / "catalog.yaml"
        path.write_text(catalog)
        self.manage("catalog", "apply", str(path))

    def hub_stats(self) -> dict:
        return httpx.get(f"{self.hub}/_stats", timeout=10).json()

    def hub_faults(self, **faults) -> None:
        httpx.post(f"{self.hub}/_faults", json=faults, timeout=10).raise_for_status()

    def log(self, name: str = "up") -> str:
        return (self.var / f"{name}.log").read_text(errors="replace")

    def start_agent(self, node: str) -> None:
        """(Re)start a node's agent, with the argv it was first started with."""
        out = (self.var / f"{node}.log").open("a")
        self.agents[node] = subprocess.Popen(
            self.agent_argv[node], cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT
        )


@contextmanager
def staging_fleet(
    var: Path, repos: Path, nodes: list[str], *, hub_rate: float | None = None, gpus: str = "1xH100-80GB",
    env: dict[str, str] | None = None,
) -> Iterator[Fleet]:  # fmt: skip
    """The mock hub over `repos` (at `hub_rate` bytes a second for all), a control plane and router, and one agent
    per node (weights root `var/weights-<node>`, a weights server); yields once every node is ready."""
    var.mkdir(parents=True, exist_ok=True)
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")} | {
        "LLMGW_HOME": str(var),
        "LLMGW_PORT": str(port),
        "LLMGW_ROUTER_PORT": str(free_port()),
        "LLMGW_TICK_SECONDS": "0.3",
        "LLMGW_HEARTBEAT_SECONDS": "0.5",
        "LLMGW_ENGINE_PORT_RANGE": engine_port_range(7),
        "LLMGW_STAGE_ENGINES": "mock",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    with ExitStack() as stack:
        hub_argv = [sys.executable, "-m", "mockhub", "--root", str(repos)]
        if hub_rate:
            hub_argv += ["--bytes-per-second", str(hub_rate)]
        hub = subprocess.Popen(hub_argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, text=True)
        stack.callback(_stop, hub)
        full_env["HF_ENDPOINT"] = hub.stdout.readline().strip()  # type: ignore[union-attr]
        fleet = Fleet(full_env, f"http://127.0.0.1:{full_env['LLMGW_ROUTER_PORT']}", "", full_env["HF_ENDPOINT"], var)
        fleet.manage("migrate", "-v0")
        up = subprocess.Popen(
            [sys.executable, "manage.py", "up"], cwd=ROOT, env=full_env,
            stdout=(var / "up.log").open("w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        stack.callback(_stop, up)
        for node in nodes:
            token = fleet.manage("enrol_node", node)
            fleet.roots[node] = var / f"weights-{node}"
            fleet.roots[node].mkdir()
            fleet.agent_argv[node] = [
                sys.executable, "-m", "agent", "--node", node, "--token", token, "--fake-gpus", gpus,
                "--weights-root", str(fleet.roots[node]), "--weights-port", str(free_port()),
                "--address", "127.0.0.1", "--state-dir", str(var / f"{node}-state"),
                "--control-plane", f"ws://127.0.0.1:{port}/agent/ws",
            ]  # fmt: skip
            fleet.start_agent(node)
            stack.callback(lambda n=node: _stop(fleet.agents[n]))
        wait_until(lambda: fleet.status()["nodes"]["ready"] == len(nodes), 90, 0.3, describe=fleet.log)
        fleet.key = fleet.manage("create_api_key", "staging").splitlines()[-1]
        yield fleet


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
