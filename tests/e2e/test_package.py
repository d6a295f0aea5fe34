"""The package as a new user gets it: the wheel built from this checkout, installed into empty virtual environments
outside it. With the `server` extra, `llmgw up --demo` in an empty folder answers a chat completion and keeps its
state in LLMGW_HOME; the base install alone is what a GPU node needs: the agent runs, and nothing of the control
plane's server stack is there."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import free_port

# Building a wheel and installing the server stack into a new virtual environment takes a minute or two.
pytestmark = [pytest.mark.e2e, pytest.mark.packaging, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-llmgw-package-test-key-0123456789"


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    built = run(sys.executable, "-m", "build", "--wheel", "--outdir", str(out), cwd=ROOT)
    assert built.returncode == 0, built.stdout + built.stderr
    (found,) = out.glob("llmgw-*.whl")
    return found


def fresh_venv(where: Path, requirement: str) -> Path:
    """A new virtual environment at `where` with `requirement` installed, at the versions requirements.txt pins."""
    assert run(sys.executable, "-m", "venv", str(where)).returncode == 0
    # pip takes no extras in constraints: the pins without them.
    constraints = where / "constraints.txt"
    pins = [line.split("[")[0] + line[line.index("]") + 1 :] if "[" in line else line for line in _pins()]
    constraints.write_text("\n".join(pins) + "\n")
    installed = run(str(where / "bin" / "pip"), "install", "--quiet", "-c", str(constraints), requirement)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return where / "bin"


def _pins() -> list[str]:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return [line for line in lines if line and not line.startswith(("#", "-"))]


def test_the_agent_installs_alone_without_the_server_stack(wheel, tmp_path):
    bin_dir = fresh_venv(tmp_path / "venv", str(wheel))
    version = run(str(bin_dir / "llmgw"), "--version")
    assert version.returncode == 0 and version.stdout.startswith("llmgw ")
    help_text = run(str(bin_dir / "llmgw"), "agent", "--help", cwd=tmp_path)
    assert help_text.returncode == 0 and "--control-plane" in help_text.stdout
    assert run(str(bin_dir / "python"), "-c", "import django").returncode != 0
    assert run(str(bin_dir / "python"), "-c", "import celery").returncode != 0
    server = run(str(bin_dir / "llmgw"), "status", cwd=tmp_path)
    assert server.returncode == 2 and "pip install 'llmgw[server]'" in server.stderr


def test_llmgw_up_demo_from_the_wheel_answers_in_an_empty_folder(wheel, tmp_path):
    bin_dir = fresh_venv(tmp_path / "venv", f"{wheel}[server]")
    folder, home = tmp_path / "empty", tmp_path / "home"
    folder.mkdir()
    port, router_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "PYTHONPATH")}
    env |= {
        "LLMGW_HOME": str(home),
        "LLMGW_DEMO_API_KEY": API_KEY,
        "LLMGW_PORT": str(port),
        "LLMGW_ROUTER_PORT": str(router_port),
        "LLMGW_TICK_SECONDS": "0.5",
    }
    log = (tmp_path / "up.log").open("w")
    process = subprocess.Popen(
        [str(bin_dir / "llmgw"), "up", "--demo"], cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        router = f"http://127.0.0.1:{router_port}"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert process.poll() is None, (tmp_path / "up.log").read_text()
            try:
                if httpx.get(f"{router}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        else:
            pytest.fail("llmgw up --demo did not become ready:\n" + (tmp_path / "up.log").read_text())
        answer = httpx.post(
            f"{router}/v1/chat/completions",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={"model": "llama3", "messages": [{"role": "user", "content": "Hello!"}]},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        assert "Hello!" in answer.json()["choices"][0]["message"]["content"]
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").json() == {"status": "ready"}
        assert httpx.get(f"http://127.0.0.1:{port}/static/admin/css/base.css").status_code == 200
    finally:
        process.terminate()
        process.wait(30)
    # State went to LLMGW_HOME: nothing into the empty folder, nothing into the installed package.
    assert {p.name for p in home.iterdir()} >= {"llmgw.sqlite3", "secret_key"}
    assert list(folder.iterdir()) == []
    site = tmp_path / "venv" / "lib"
    assert not list(site.rglob("*.sqlite3")) and not list(site.rglob("secret_key"))
