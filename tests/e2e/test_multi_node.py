"""End to end: a replica spanning two nodes, on mock engines, from placement to loss of a node.

`manage.py up` (control plane, router and ticker, no demo) and three agents,
each its own process with two simulated H100s on one fabric. A model wants
one replica of 2 nodes × 2 GPUs. The test checks what production sends and
does: the ranks, head address, rendezvous port and engine ports of the
start_shard commands the agents carried out; the replica ready only once
every shard is (each node's engines are held back by a file until the test
lets them go); a request served through the router by the head; when one
node's agent is killed, the replica placed again as one, both shards on a
new pair; and a drain that stops the replica as one, its head first.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from conftest import engine_port_range, free_port, wait_until

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-llmgw-e2e-multi-node-0123456789"
NODES = ("n1", "n2", "n3")
# Run once against the stack's database: the model, the nodes' credentials, a router key and a REST token.
SETUP = f"""
import json
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from catalog.models import Model, Profile
from inventory.services import enrol_node
from keys.models import ApiKey

ApiKey.issue("e2e", {KEY!r})
user = get_user_model().objects.create_user("ops", is_staff=True)
model = Model.objects.create(name="big", source="org/big")
Profile.objects.create(model=model, engine="mock", gpu_class="H100-80GB", gpus_per_node=2, nodes_per_replica=2,
                       min_replicas=1, max_replicas=1, idle_timeout_seconds=0)
tokens = {{name: enrol_node(name, address="127.0.0.1", fabric="ib-a")[1] for name in {NODES!r}}}
print(json.dumps({{"rest": Token.objects.create(user=user).key, "nodes": tokens}}))
"""
START_LINE = re.compile(r"shard (\d+): rank (\d+) of 2, head (\S+), rendezvous port (\d+), port (\d+)")


class Stack:
    """The processes of one test, their logs, and the REST API."""

    def __init__(self, tmp: Path, exits: ExitStack):
        self.tmp, self.exits = tmp, exits
        self.port, router_port = free_port(), free_port()
        self.env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")} | {
            "LLMGW_HOME": str(tmp),
            "LLMGW_PORT": str(self.port),
            "LLMGW_ROUTER_PORT": str(router_port),
            "LLMGW_TICK_SECONDS": "0.3",
            "LLMGW_HEARTBEAT_SECONDS": "0.3",
            "LLMGW_LAST_SEEN_FLUSH_SECONDS": "0.2",
            "LLMGW_UNREACHABLE_AFTER_SECONDS": "1.5",
            "LLMGW_LOST_AFTER_SECONDS": "2",
            "LLMGW_ENGINE_PORT_RANGE": engine_port_range(1),
            "PYTHONUNBUFFERED": "1",
        }
        self.router = f"http://127.0.0.1:{router_port}"
        self.procs: dict[str, subprocess.Popen] = {}

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = self.exits.enter_context(open(self.tmp / f"{name}.log", "w"))  # noqa: SIM115 (closed by the stack)
        proc = subprocess.Popen(argv, cwd=ROOT, env=env or self.env, stdout=log, stderr=subprocess.STDOUT)
        self.exits.callback(lambda: proc.poll() is None and (proc.kill(), proc.wait(10)))
        self.procs[name] = proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def agent(self, node: str, token: str) -> None:
        argv = [sys.executable, "-m", "agent", "--control-plane", f"ws://127.0.0.1:{self.port}/agent/ws"]
        argv += ["--node", node, "--token", token, "--fake-gpus", "2xH100-80GB", "--fabric", "ib-a"]
        argv += ["--address", "127.0.0.1", "--state-dir", str(self.tmp / f"state-{node}")]
        # Each node's mock engines answer /health only once the test removes the node's hold file.
        self.spawn(node, argv, self.env | {"LLMGW_MOCK_HOLD_FILE": str(self.hold(node))})

    def hold(self, node: str) -> Path:
        return self.tmp / f"hold-{node}"

    def replicas(self) -> list[dict]:
        response = httpx.get(f"http://127.0.0.1:{self.port}/api/v1/replicas/?model=big", headers=self.auth, timeout=10)
        response.raise_for_status()
        body = response.json()
        return body["results"] if isinstance(body, dict) else body

    def starts(self, node: str) -> dict[int, tuple[int, str, int, int]]:
        """The multi-node start_shard commands the node's agent carried out: shard → (rank, head, rendezvous, port)."""
        found = START_LINE.findall(self.log(node))
        return {int(s): (int(rank), head, int(rdv), int(port)) for s, rank, head, rdv, port in found}


def one_replica(stack: Stack, state: str, timeout: float = 15) -> dict:
    def found():
        replicas = [r for r in stack.replicas() if r["state"] == state]
        return replicas[0] if len(replicas) == 1 else None

    wait_until(found, timeout, 0.1, describe=lambda: f"{stack.replicas()}\n" + stack.log("up"))
    return found()


def check_starts(stack: Stack, replica: dict, known: set[int]) -> tuple[int, int, int]:
    """The new shards' start commands agree on the world; returns (head shard, other shard, head port)."""
    head_node, other_node = replica["nodes"]
    wait_until(lambda: set(stack.starts(other_node)) - known, 10, 0.1, describe=lambda: stack.log(other_node))
    # The newest on each node: a placement that failed on the way (a port still held) may have started others.
    head_shard = max(s for s in stack.starts(head_node) if s not in known)
    other_shard = max(s for s in stack.starts(other_node) if s not in known)
    head_start, other_start = stack.starts(head_node)[head_shard], stack.starts(other_node)[other_shard]
    head_port = head_start[3]
    assert head_start == (0, "127.0.0.1", head_port + 1, head_port)
    # The other rank meets the head at the head's rendezvous port; its own port is another (one host, here).
    assert other_start[:3] == (1, "127.0.0.1", head_port + 1)
    assert other_start[3] not in (head_port, head_port + 1)
    return head_shard, other_shard, head_port


def test_a_two_node_replica_starts_serves_moves_and_drains_as_one(tmp_path):
    with ExitStack() as exits:
        stack = Stack(tmp_path, exits)
        stack.spawn("up", [sys.executable, "manage.py", "up"])
        wait_until(
            lambda: "router" in stack.log("up") and _serves(stack.router), 60, 0.2, describe=lambda: stack.log("up")
        )
        setup = subprocess.run(
            [sys.executable, "manage.py", "shell", "-c", SETUP], cwd=ROOT, env=stack.env,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert setup.returncode == 0, setup.stderr
        created = json.loads(setup.stdout.strip().splitlines()[-1])
        stack.auth = {"Authorization": f"Token {created['rest']}"}
        for node in NODES:
            stack.hold(node).touch()
            stack.agent(node, created["nodes"][node])

        # Placed on two whole nodes; the head's engine is let go first: the replica still waits for rank 1.
        replica = one_replica(stack, "starting")
        head_node, other_node = replica["nodes"]
        head_shard, other_shard, head_port = check_starts(stack, replica, set())
        stack.hold(head_node).unlink()
        wait_until(lambda: f"shard {head_shard} on {head_node}: ready" in stack.log(head_node), 10, 0.05)
        time.sleep(1.0)  # three ticks: nothing may publish a replica with a shard still starting
        assert [r["state"] for r in stack.replicas()] == ["starting"]
        stack.hold(other_node).unlink()
        replica = one_replica(stack, "ready")
        assert replica["endpoint_url"] == f"http://127.0.0.1:{head_port}"

        client = OpenAI(base_url=stack.router + "/v1", api_key=KEY, timeout=30, max_retries=0)
        reply = client.chat.completions.create(model="big", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content.startswith("mock reply from big")

        # The other rank's node is lost: the replica is placed again as one, both shards on a new pair.
        for node in NODES:
            stack.hold(node).unlink(missing_ok=True)
        stack.procs[other_node].send_signal(signal.SIGKILL)
        wait_until(
            lambda: f"shard {head_shard} on {head_node}: stopped" in stack.log(head_node), 15, 0.1,
            describe=lambda: stack.log("up"),
        )  # fmt: skip
        moved = one_replica(stack, "ready")
        assert moved["id"] == replica["id"]
        assert sorted(moved["nodes"]) == sorted(n for n in NODES if n != other_node)
        new_head, new_other, new_port = check_starts(stack, moved, {head_shard, other_shard})
        assert reply_from(client) and moved["endpoint_url"] == f"http://127.0.0.1:{new_port}"

        # Drained as one, head first: both shards stop, having no requests in flight, and the replica goes away.
        response = httpx.post(
            f"http://127.0.0.1:{stack.port}/api/v1/replicas/{moved['id']}/drain/", headers=stack.auth, timeout=10
        )
        assert response.status_code == 200, response.text
        stopped_at = {}
        for shard, node in ((new_head, moved["nodes"][0]), (new_other, moved["nodes"][1])):
            stopped = re.compile(rf"^(\S+ \S+) .*shard {shard} on {node}: stopped \(drained: no running requests", re.M)
            wait_until(lambda s=stopped, n=node: s.search(stack.log(n)), 10, 0.1, describe=lambda n=node: stack.log(n))
            stopped_at[shard] = stopped.search(stack.log(node)).group(1)
        draining = re.search(rf"^(\S+ \S+) .*shard {new_other}: draining", stack.log(moved["nodes"][1]), re.M)
        # The other rank is asked to drain only once the head has stopped (same clock: one machine).
        assert stopped_at[new_head] <= draining.group(1) <= stopped_at[new_other]
        wait_until(lambda: moved["id"] not in [r["id"] for r in stack.replicas()], 10, 0.1)


def reply_from(client) -> str:
    reply = client.chat.completions.create(model="big", messages=[{"role": "user", "content": "again"}])
    return reply.choices[0].message.content


def _serves(router: str) -> bool:
    try:
        return httpx.get(router + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
