"""End to end, real processes: `manage.py up` and two `python -m agent` nodes with weights roots.

The replica goes on the node holding its weights (though the other comes
first by name); a drill makes that node's GPU unhealthy; the replica fails,
naming the node, GPU and reason, and comes back on the other node. Deleting
the model through the REST API deletes its weights from the holder's disk.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import engine_port_range, free_port, wait_until
from tests.e2e.demo_stack import ctl_status

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CATALOG = """models:
- name: tiny
  source: org/tiny
  enabled: true
  aliases: []
  profiles:
  - {engine: mock, gpu_class: H100-80GB, gpus_per_node: 1, min_replicas: 1, max_replicas: 1}
"""


def manage(env, *args) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def ready_on(env) -> list[str] | None:
    ready = [r["nodes"] for r in ctl_status(env)["replica_list"] if r["state"] == "ready"]
    return ready[0] if ready else None


def test_weights_first_placement_a_gpu_fault_moves_the_replica_and_deleting_the_model_frees_the_disk(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")} | {
        "LLMGW_HOME": str(tmp_path),
        "LLMGW_PORT": str(port),
        "LLMGW_ROUTER_PORT": str(free_port()),
        "LLMGW_TICK_SECONDS": "0.3",
        "LLMGW_HEARTBEAT_SECONDS": "0.3",
        "LLMGW_BACKOFF_BASE_SECONDS": "0.5",
        "LLMGW_ENGINE_PORT_RANGE": engine_port_range(6),
        "PYTHONUNBUFFERED": "1",
    }
    manage(env, "migrate", "-v0")
    manage(
        env,
        "shell",
        "-c",
        "from django.contrib.auth.models import User; User.objects.create_user('ops', is_staff=True)",
    )
    api_token = manage(env, "create_api_token", "ops")
    roots = {}
    for node in ("n1", "n2"):
        roots[node] = tmp_path / f"weights-{node}"
        roots[node].mkdir()
    held = roots["n2"] / "hub" / "models--org--tiny"
    (held / "blobs").mkdir(parents=True)
    (held / "blobs" / "0123").write_bytes(b"w" * 4096)

    processes = []
    log = tmp_path / "up.log"
    try:
        processes.append(
            subprocess.Popen(
                [sys.executable, "manage.py", "up"], cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
            )
        )
        for node in ("n1", "n2"):
            token = manage(env, "enrol_node", node)
            agent_log = (tmp_path / f"{node}.log").open("w")
            processes.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "agent",
                        "--node",
                        node,
                        "--token",
                        token,
                        "--fake-gpus",
                        "1xH100-80GB",
                        "--fake-gpu-health",
                        str(tmp_path / f"{node}-health.json"),
                        "--weights-root",
                        str(roots[node]),
                        "--address",
                        "127.0.0.1",
                        "--state-dir",  # one per node: a state directory belongs to one node
                        str(tmp_path / f"{node}-state"),
                        "--control-plane",
                        f"ws://127.0.0.1:{port}/agent/ws",
                    ],
                    cwd=ROOT,
                    env=env,
                    stdout=agent_log,
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
            )
        # Both nodes in before the model exists, so the placer has the choice.
        wait_until(lambda: ctl_status(env)["nodes"]["ready"] == 2, 60, 0.3, describe=log.read_text)
        (tmp_path / "catalog.yaml").write_text(CATALOG)
        manage(env, "catalog", "apply", str(tmp_path / "catalog.yaml"))
        # n1 comes first by name, but n2 holds the weights: weights first.
        assert wait_until(lambda: ready_on(env), 60, 0.3, describe=log.read_text) == ["n2"]
        nodes = {n["name"]: n for n in ctl_status(env)["node_list"]}
        assert [(w["source"], w["size"]) for w in nodes["n2"]["weights"]] == [("org/tiny", "4.0 KiB")]

        (tmp_path / "n2-health.json").write_text(json.dumps({"0": "XID 79 (drill)"}))
        assert wait_until(lambda: ready_on(env) == ["n1"] and ["n1"], 60, 0.3, describe=log.read_text) == ["n1"]
        assert "GPU 0 on n2 is unhealthy: XID 79 (drill)" in log.read_text()
        nodes = {n["name"]: n for n in ctl_status(env)["node_list"]}
        assert (nodes["n2"]["unhealthy"], nodes["n1"]["used"]) == (1, 1)

        response = httpx.delete(
            f"http://127.0.0.1:{port}/api/v1/models/tiny", headers={"Authorization": f"Token {api_token}"}
        )
        assert response.status_code == 204, response.text
        wait_until(lambda: not held.exists(), 30, 0.2, describe=lambda: (tmp_path / "n2.log").read_text())
        wait_until(lambda: not any(n["weights"] for n in ctl_status(env)["node_list"]), 30, 0.3, describe=log.read_text)
        assert roots["n2"].is_dir()  # the root itself is never removed
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
