"""The fleet of deploy/compose.yaml, brought up from the image with podman as an operator would: PostgreSQL,
Redis, two control-plane servers, a router, beat, a worker and three agents of simulated GPUs. A chat
completion goes through its router with the openai SDK; the agent container serving the model is removed and
its replica is placed again on another node; `down` leaves nothing running.

Needs podman (.ci/run installs it, with runc and mmdebstrap); without it the test says so and skips. The base
images are made from Debian's packages and cached in ~/.cache/llmgw/image, so a second run rebuilds only the
llmgw image (about a minute)."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import free_port

# Building the image and starting eleven containers on two cores takes minutes.
pytestmark = [pytest.mark.e2e, pytest.mark.packaging, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent / "compose"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llmgw" / "image"
PROJECT = "llmgw-e2e"
API_KEY = "sk-llmgw-compose-e2e-0123456789abcdef"
SERVICES_IMAGE = "localhost/llmgw-test-services:bookworm"
# podman-compose is pinned in requirements-dev.txt: beside this Python, whatever PATH says.
PODMAN_COMPOSE = str(Path(sys.executable).parent / "podman-compose")


def sh(*args: str, check: bool = True, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def podman_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(HERE / "containers.conf"))}


def services_image() -> None:
    """PostgreSQL and Redis in one image from Debian's packages (services.Containerfile), built once."""
    env = podman_env()
    if sh("podman", "image", "exists", SERVICES_IMAGE, check=False, env=env).returncode == 0:
        return
    rootfs = CACHE / "services-rootfs.tar"
    if not rootfs.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        packages = "postgresql,redis-server,redis-tools,util-linux"
        sh("mmdebstrap", "--variant=minbase", f"--include={packages}", "bookworm", str(rootfs), env=env)
    sh("podman", "import", str(rootfs), "localhost/llmgw-test-services-base:bookworm", env=env)
    sh("podman", "build", "-t", SERVICES_IMAGE, "-f", str(HERE / "services.Containerfile"), str(HERE), env=env)


def compose(*args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    command = [PODMAN_COMPOSE, "-p", PROJECT, "-f", str(ROOT / "deploy" / "compose.yaml"), *args]
    return sh(*command, env=env, check=check)


def replica_nodes(env: dict[str, str]) -> dict[str, list[str]]:
    """Ready replica id -> the nodes it runs on, as `llmgw status --json` on a server says."""
    status = sh("podman", "exec", f"{PROJECT}_server-1_1", "llmgw", "status", "--json", env=env)
    replicas = json.loads(status.stdout)["replica_list"]
    return {str(r["id"]): r["nodes"] for r in replicas if r["state"] == "ready"}


def chat(client: openai.OpenAI) -> str:
    """One chat completion through the router; the replica that answered."""
    raw = client.chat.completions.with_raw_response.create(
        model="llama3", messages=[{"role": "user", "content": "Hello!"}]
    )
    assert "Hello!" in raw.parse().choices[0].message.content
    return raw.headers["x-llmgw-replica"]


def wait_for(what: str, check, timeout: float):
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            found = check()
            if found:
                return found
        except (httpx.HTTPError, openai.APIError, subprocess.SubprocessError, KeyError) as exc:
            last = exc
        time.sleep(1)
    pytest.fail(f"{what} within {timeout:g} s (last error: {last!r})")


def test_the_compose_fleet_answers_survives_an_agents_death_and_leaves_nothing_behind():
    if shutil.which("podman") is None or not Path(PODMAN_COMPOSE).exists():
        pytest.skip("NO PODMAN: install podman, runc and mmdebstrap (apt-get) and podman-compose (pip) to run this")
    env = podman_env()
    sh("make", "--no-print-directory", "image-base", "image", cwd=ROOT, env=env, timeout=900)
    services_image()
    router_port = free_port()
    env |= {
        "LLMGW_POSTGRES_IMAGE": SERVICES_IMAGE,
        "LLMGW_REDIS_IMAGE": SERVICES_IMAGE,
        "LLMGW_COMPOSE_API_KEY": API_KEY,
        "LLMGW_ROUTER_PORT": str(router_port),
    }
    compose("down", "-v", env=env, check=False)  # a run cut short before leaves its containers
    volumes_before = set(sh("podman", "volume", "ls", "--quiet", env=env).stdout.split())
    try:
        compose("up", "-d", env=env)
        router = f"http://127.0.0.1:{router_port}"
        wait_for("the router became ready", lambda: httpx.get(f"{router}/readyz", timeout=2).status_code == 200, 240)
        client = openai.OpenAI(base_url=f"{router}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        first = wait_for("a chat completion through the router", lambda: chat(client), 240)
        (node,) = replica_nodes(env)[first]
        sh("podman", "rm", "--force", f"{PROJECT}_{node}_1", env=env)  # the node is gone, engines and all
        # The lost node's replica is placed again elsewhere (the same replica, on a node that is alive).
        moved = wait_for(
            f"the replica on {node} replaced on another node",
            lambda: (nodes := replica_nodes(env).get(chat(client))) and node not in nodes and nodes,
            180,
        )
        assert node not in moved
    finally:
        compose("down", "-v", env=env, check=False)
    left = sh("podman", "ps", "--all", "--quiet", "--filter", f"label=io.podman.compose.project={PROJECT}", env=env)
    assert left.stdout.strip() == ""
    assert set(sh("podman", "volume", "ls", "--quiet", env=env).stdout.split()) <= volumes_before  # none left
