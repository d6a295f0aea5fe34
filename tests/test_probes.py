"""The control plane's liveness and readiness probes (llmgw_site.probes): /healthz answers while the process runs,
/readyz only when its database and Redis answer, naming what it cannot reach; neither needs a credential nor shows
in the access log. The control plane runs as operators run it (uvicorn on llmgw_site.asgi), on real databases and
a real Redis, and on ports where nothing listens. The router's probes: router/tests/test_probes.py."""

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent


def serve_control_plane(tmp_path, **env):
    port = free_port()
    log = (tmp_path / "control-plane.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "llmgw_site.asgi:application", "--port", str(port), "--lifespan", "off"],
        cwd=ROOT,
        env={**os.environ, "LLMGW_HOME": str(tmp_path), "SECRET_KEY": "test-only", **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def answers():
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(answers, timeout=30)
    return process, url


@pytest.fixture
def control_plane(tmp_path):
    started = []

    def start(**env):
        process, url = serve_control_plane(tmp_path, **env)
        started.append(process)
        return url

    yield start
    for process in started:
        process.terminate()
        process.wait(10)


def requests_counted(metrics: str, name: str) -> float:
    (line,) = [line for line in metrics.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


def dead_url(scheme: str) -> str:
    return (
        f"{scheme}://postgres@127.0.0.1:{free_port()}/llmgw"
        if scheme == "postgres"
        else f"redis://127.0.0.1:{free_port()}/0"
    )


def test_the_control_plane_is_ready_with_its_database_and_redis(control_plane, redis_url, tmp_path):
    url = control_plane(
        REDIS_URL=redis_url, DATABASE_URL="postgres://postgres@127.0.0.1:5432/postgres", LLMGW_METRICS_TOKEN=""
    )
    ready = httpx.get(f"{url}/readyz")
    assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
    assert httpx.get(f"{url}/healthz").json() == {"status": "alive"}
    # Outside auth and sessions: no cookie set, no redirect to a login page.
    assert "set-cookie" not in ready.headers
    # Left out of the request metrics: between two scrapes only the first scrape itself is counted.
    counted = "django_http_requests_before_middlewares_total"
    before = requests_counted(httpx.get(f"{url}/metrics").text, counted)
    for _ in range(3):
        httpx.get(f"{url}/readyz")
        httpx.get(f"{url}/healthz")
    assert requests_counted(httpx.get(f"{url}/metrics").text, counted) == before + 1
    # Left out of the access log, unlike any other request.
    httpx.get(f"{url}/api/v1/nodes")
    log = (tmp_path / "control-plane.log").read_text()
    assert "/api/v1/nodes" in log and "/readyz" not in log and "/healthz" not in log


def test_the_control_plane_is_alive_but_not_ready_without_its_database_or_redis(control_plane):
    url = control_plane(REDIS_URL=dead_url("redis"), DATABASE_URL=dead_url("postgres"))
    assert httpx.get(f"{url}/healthz").status_code == 200
    ready = httpx.get(f"{url}/readyz", timeout=10)
    assert ready.status_code == 503
    body = ready.json()
    assert body["status"] == "not_ready" and set(body["failed"]) == {"database", "redis"}
    assert "Connection refused" in body["failed"]["redis"] or "Error" in body["failed"]["redis"]


def test_an_embedded_control_plane_needs_no_redis_to_be_ready(control_plane):
    url = control_plane(REDIS_URL="", DATABASE_URL="")  # SQLite in its own folder, the in-process hub
    assert httpx.get(f"{url}/readyz").json() == {"status": "ready"}
