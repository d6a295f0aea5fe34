"""The distributed stack as README runs it, on private PostgreSQL and Redis servers the drill owns.

Every process is real and started from this checkout: two control planes
(uvicorn), two routers (uvicorn), Celery beat and workers, and three agents
(`python -m agent`, simulated GPUs, the bundled mock engine). Each writes its
log under the drill's work directory; `Proc` can signal, pause and restart it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PG_BIN = Path("/usr/lib/postgresql/15/bin")
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition") -> float:
    """Seconds until predicate() was true; TimeoutError naming `what` after `timeout`."""
    started = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - started
        except Exception:  # a server still starting: keep asking
            pass
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{what} not reached within {timeout:g} s")
        time.sleep(interval)


@dataclass
class Proc:
    """One process of the stack, restartable with the same command line."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen | None = None
    paused: bool = False

    def start(self) -> Proc:
        handle = self.log.open("a")
        self.popen = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=handle, stderr=subprocess.STDOUT)
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)
        self.paused = sig == signal.SIGSTOP or (self.paused and sig != signal.SIGCONT)

    def stop(self, timeout: float = 10.0) -> float | None:
        """SIGTERM, then SIGKILL after `timeout`; seconds it took to exit (None if it had to be killed)."""
        if not self.alive():
            return 0.0
        if self.paused:
            self.signal(signal.SIGCONT)
        started = time.monotonic()
        self.popen.terminate()
        try:
            self.popen.wait(timeout)
            return time.monotonic() - started
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
            return None

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait(10)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class PrivatePostgres:
    """A PostgreSQL cluster in a temporary directory, on its own port, run as the `postgres` user."""

    def __init__(self, workdir: Path):
        self.dir = workdir / "pg"
        self.port = free_port()
        self.log = workdir / "postgres.log"

    def _run(self, *argv: str) -> None:
        command = ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else list(argv)
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def init(self) -> None:
        self.dir.mkdir(parents=True)
        self.log.touch()
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
            shutil.chown(self.log, "postgres", "postgres")
        self._run(str(PG_BIN / "initdb"), "-D", str(self.dir / "data"), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        self.start()
        self._run(str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "llmgw")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run(
            str(PG_BIN / "pg_ctl"), "-D", str(self.dir / "data"), "-o", options, "-l", str(self.log), "-w", "start"
        )

    def stop(self) -> None:
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.dir / "data"), "-m", "fast", "-w", "stop")

    def url(self, application_name: str = "") -> str:
        query = f"?application_name={application_name}" if application_name else ""
        return f"postgres://postgres@127.0.0.1:{self.port}/llmgw{query}"


class PrivateRedis:
    """A Redis server on its own port that keeps nothing on disk."""

    def __init__(self, workdir: Path):
        self.port = free_port()
        self.proc = Proc(
            "redis",
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir)],
            dict(os.environ),
            workdir / "redis.log",
        )  # fmt: skip

    def start(self) -> None:
        self.proc.start()
        wait_for(lambda: socket.create_connection(("127.0.0.1", self.port), 0.2).close() is None, 10, what="redis")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@dataclass
class Stack:
    """Everything the drill runs, and the settings it runs it with."""

    workdir: Path
    settings: dict[str, str]
    pg: PrivatePostgres | None = None
    redis: PrivateRedis | None = None
    database_url: str = ""
    redis_url: str = ""
    control_planes: list[Proc] = field(default_factory=list)
    routers: list[Proc] = field(default_factory=list)
    workers: list[Proc] = field(default_factory=list)
    beats: list[Proc] = field(default_factory=list)
    agents: dict[str, Proc] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def env(self, application_name: str = "") -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        url = self.pg.url(application_name) if self.pg else self.database_url
        return (
            base
            | self.settings
            | {
                "DATABASE_URL": url,
                "REDIS_URL": self.redis_url,
                "SECRET_KEY": "fault-drill-only",
                "LLMGW_HOME": str(self.workdir / "var"),
                "PYTHONUNBUFFERED": "1",
                "LOG_LEVEL": "INFO",
            }
        )

    def proc(self, name: str, argv: list[str]) -> Proc:
        return Proc(name, argv, self.env(name), self.workdir / f"{name}.log")

    def control_plane(self, index: int) -> Proc:
        port = self.ports.setdefault(f"cp{index}", free_port())
        return self.proc(f"cp{index}", [PYTHON, "-m", "uvicorn", "llmgw_site.asgi:application", "--port", str(port)])

    def router(self, index: int) -> Proc:
        port = self.ports.setdefault(f"router{index}", free_port())
        argv = [PYTHON, "-m", "uvicorn", "router.asgi:application", "--port", str(port), "--loop", "uvloop",
                "--http", "httptools", "--no-access-log", "--no-proxy-headers"]  # fmt: skip
        return self.proc(f"router{index}", argv)

    def worker(self, index: int) -> Proc:
        # As README runs it: a solo pool, the default queue; the leader also takes `reconcile-leader`.
        argv = [PYTHON, "-m", "celery", "-A", "llmgw_site", "worker", "-n", f"reconciler{index}@%h", "--pool", "solo",
                "--loglevel", "INFO", "-Q", "celery", "--without-mingle", "--without-gossip"]  # fmt: skip
        return self.proc(f"worker{index}", argv)

    def beat(self, index: int) -> Proc:
        # RedBeat's lock in Redis lets every control-plane host run a beat; one schedules.
        argv = [PYTHON, "-m", "celery", "-A", "llmgw_site", "beat", "--loglevel", "INFO"]
        return self.proc(f"beat{index}", argv)

    def agent(self, node: str, token: str, gpus: str, fabric: str) -> Proc:
        # Each agent its own state directory, kept across its restarts in the drill (as on a real node).
        argv = [PYTHON, "-m", "agent", "--node", node, "--token", token, "--fake-gpus", gpus, "--fabric", fabric,
                "--address", "127.0.0.1", "--state-dir", str(self.workdir / "agent-state" / node)]  # fmt: skip
        for cp in ("cp1", "cp2"):
            argv += ["--control-plane", f"ws://127.0.0.1:{self.ports[cp]}/agent/ws"]
        return self.proc(f"agent-{node}", argv)

    def all_procs(self) -> list[Proc]:
        return [*self.agents.values(), *self.routers, *self.workers, *self.beats, *self.control_planes]

    def stop_all(self) -> None:
        for proc in self.all_procs():
            proc.stop(timeout=5)
        if self.redis is not None:
            self.redis.proc.stop(5)
        if self.pg is not None:
            with contextlib.suppress(subprocess.CalledProcessError):
                self.pg.stop()
