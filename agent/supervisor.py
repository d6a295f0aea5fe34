"""One engine subprocess, from launch to exit: what the agent needs to supervise an engine.

An engine is started from an argv (agent/engines/launch.py), never through a shell,
in its own process group so a stop reaches the workers it spawns. It outlives
a dropped control-plane connection but not the agent: the kernel sends it
SIGTERM when the agent dies, even by SIGKILL (Linux parent-death signal).

`Shard` is what the agent keeps for each engine it started for a shard of a
replica; what shards are asked to do comes from agent/runtime.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import enum
import logging
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import msgspec

from agent.engines.launch import Launch
from nodewire import parts, protocol

log = logging.getLogger(__name__)

OUTPUT_LINES = 50
# A rank without a health endpoint counts as ready once its process has stayed up this long.
NO_HTTP_SETTLE_SECONDS = 1.0
PR_SET_PDEATHSIG = 1


class Readiness(enum.Enum):
    """How waiting for an engine to become healthy ended."""

    READY = "ready"
    EXITED = "exited"
    TIMED_OUT = "timed out"


def port_in_use(port: int, host: str = "0.0.0.0") -> bool:
    """Whether an engine could not listen on `port` on this node.

    Tried on every interface whatever `host` the engine will use, so a port held on any address counts
    (an IPv6 `host` is tried on the IPv6 wildcard).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As servers do, so connections of a previous engine in TIME_WAIT do not count as "in use".
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        except OSError:
            return True
    return False


def _die_with_parent_preexec() -> Callable[[], None] | None:
    """A preexec_fn asking the kernel to SIGTERM the child when the agent dies (Linux only)."""
    parent = os.getpid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        # The agent may have died between fork and prctl; then nobody would signal us.
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


class EngineProcess:
    """A running engine subprocess: its last lines of output, readiness, and termination.

    Create with `await EngineProcess.launch(...)` inside the event loop that
    will supervise it.
    """

    def __init__(self, process: asyncio.subprocess.Process, name: str):
        self.name = name
        self._process = process
        self._output: collections.deque[str] = collections.deque(maxlen=OUTPUT_LINES)
        self._reader = asyncio.create_task(self._collect_output(), name=f"{name}-output")

    @classmethod
    async def launch(cls, argv: list[str], env: dict[str, str], cwd: str | None, name: str) -> EngineProcess:
        """Start `argv` with exactly `env`; OSError if it cannot be run."""
        process = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            cwd=cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            preexec_fn=_die_with_parent_preexec(),
            # Its own process group, so a stop reaches the engine's workers too.
            start_new_session=True,
        )
        return cls(process, name)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def running(self) -> bool:
        return self._process.returncode is None

    def last_output(self, lines: int = 20) -> str:
        """The engine's last lines of output, for failure messages."""
        return "\n".join(list(self._output)[-lines:])

    async def _collect_output(self) -> None:
        # Bounded: only the last lines are kept.
        stream = self._process.stdout
        assert stream is not None
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line longer than the stream limit: keep going with the next
                continue
            if not line:
                return
            text = line.decode("utf-8", "replace").rstrip()
            self._output.append(text)
            # Each line says whose it is: many engines share one agent's log.
            log.info("%s: %s", self.name, text)

    async def wait_ready(
        self, port: int, health_path: str | None, timeout: float, host: str = "127.0.0.1"
    ) -> Readiness:
        """Poll the engine's health endpoint until it answers 200, the process exits, or `timeout` passes.

        With no health path, the engine is ready once it has stayed up for
        NO_HTTP_SETTLE_SECONDS. Cancel the call to stop waiting.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout
        url = f"http://{host}:{port}{health_path or ''}"
        interval = 0.05
        exited = asyncio.ensure_future(self._process.wait())
        try:
            async with httpx.AsyncClient(trust_env=False, timeout=2.0) as client:
                while self.running:
                    if health_path is None:
                        healthy = loop.time() - started >= NO_HTTP_SETTLE_SECONDS
                    else:
                        try:
                            healthy = (await client.get(url)).status_code == 200
                        except httpx.HTTPError:
                            healthy = False
                    if healthy and self.running:
                        return Readiness.READY
                    if loop.time() >= deadline:
                        return Readiness.TIMED_OUT
                    await asyncio.wait({exited}, timeout=interval)
                    interval = min(1.0, interval * 1.5)
        finally:
            if not exited.done():
                exited.cancel()
        return Readiness.EXITED

    async def wait_exit(self) -> int:
        """Wait until the engine exits; return its exit code, with its output read to the end."""
        code = await self._process.wait()
        # Let the reader drain the pipe so the caller's message carries the engine's last words.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._reader), 1.0)
        return code

    async def terminate(self, grace: float) -> int:
        """SIGTERM the engine's process group, SIGKILL it after `grace` seconds; return the exit code."""
        if self.running:
            self._signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(self._process.wait()), grace)
            except TimeoutError:
                log.warning("%s ignored SIGTERM for %g s; killing it", self.name, grace)
        # Workers the engine left behind in its group are killed too.
        self._signal(signal.SIGKILL)
        code = await self._process.wait()
        self._reader.cancel()
        return code

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self._process.pid, sig)
        except (ProcessLookupError, PermissionError):
            if self.running:
                with contextlib.suppress(ProcessLookupError):
                    self._process.send_signal(sig)


# States in which an engine serves requests, so its load is worth reading (a sleeping one holds what
# arrives, uncounted by vLLM's own gauges, so its load is not known).
SERVING_STATES = ("ready", "draining", "falling_asleep")


@dataclass
class Shard:
    """An engine this agent started for one shard of a replica."""

    shard_id: int
    replica_id: int | None
    port: int
    launch: Launch
    engine: EngineProcess
    # starting | ready | draining, or falling_asleep | sleeping | waking (agent/hibernation.py), until it is gone
    state: str = "starting"
    stopping: bool = False
    watch: asyncio.Task | None = None
    stop_task: asyncio.Task | None = None
    sleep_task: asyncio.Task | None = None
    # The level it sleeps at, while sleeping or waking.
    sleep_level: protocol.SleepLevel | None = None
    # Set by a stop (or shutdown) to end a drain at once.
    stop_now: asyncio.Event = field(default_factory=asyncio.Event)
    # The LoRA adapters its engine holds, by name: loaded and not unloaded since it started (agent/adapters.py).
    adapters: set[str] = field(default_factory=set)
    # The newest adapter command under way: each waits for the one before it (agent/adapters.py).
    adapter_task: asyncio.Task | None = None

    def report(self) -> parts.RunningShard:
        return parts.RunningShard(shard_id=self.shard_id, replica_id=self.replica_id, state=self.state, port=self.port)

    def heartbeat(self, running: int | None) -> parts.ShardHeartbeat:
        """The shard as a heartbeat reports it, with `running` requests; its adapters when it takes any."""
        adapters = sorted(self.adapters) if self.launch.adapters is not None else msgspec.UNSET
        return parts.ShardHeartbeat(shard_id=self.shard_id, state=self.state, running=running, adapters=adapters)
