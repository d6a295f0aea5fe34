"""The node agent: holds a WebSocket to the control plane and runs engine shards.

One `Agent` per node. It connects to /agent/ws with the node's credential,
says `hello` (its GPUs and the shards it runs now), sends a `heartbeat` on an
interval, and carries out `start_shard`, `stop_shard` and `drain_shard`,
answering each with `shard_status` (message shapes in agent/protocol.py).

Engines are real subprocesses started from an argv (agent/engines.py), never a
shell. They outlive a dropped connection (the control plane adopts them on
reconnect) but not the agent: each is asked by the kernel to stop when the
agent dies, even by SIGKILL.

The Agent installs no signal handlers, so several can run as tasks in one
event loop (`manage.py up`); whoever owns the loop calls `shutdown()`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import json
import logging
import os
import random
import signal
import socket
import sys
from dataclasses import dataclass, field

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from . import protocol
from .engines import Launch, build_launch
from .gpus import GPUInfo

log = logging.getLogger(__name__)

AGENT_VERSION = "0.1.0"
OUTPUT_LINES = 50
STOP_GRACE_SECONDS = 10.0
# A rank without a health endpoint counts as ready once its process has stayed up this long.
NO_HTTP_SETTLE_SECONDS = 1.0
BACKOFF_FIRST_SECONDS = 0.2
BACKOFF_MAX_SECONDS = 30.0
PR_SET_PDEATHSIG = 1


class AgentRejected(Exception):
    """The control plane refused this node's credential; retrying would not help."""


class AgentSuperseded(AgentRejected):
    """Another connection for this node replaced ours; this process no longer speaks for the node."""


def _die_with_parent_preexec():
    """A preexec_fn asking the kernel to SIGTERM the child when the agent dies (Linux only)."""
    parent = os.getpid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def preexec():
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        # The agent may have died between fork and prctl; then nobody would signal us.
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As servers do, so connections of a previous engine in TIME_WAIT do not count as "in use".
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


@dataclass
class Shard:
    """An engine process this agent started for one shard of a replica."""

    shard_id: int
    replica_id: int | None
    port: int
    engine: str
    launch: Launch
    process: asyncio.subprocess.Process
    state: str = "starting"  # starting | ready, until the process is gone
    output: collections.deque = field(default_factory=lambda: collections.deque(maxlen=OUTPUT_LINES))
    stopping: bool = False
    tasks: list[asyncio.Task] = field(default_factory=list)
    stop_task: asyncio.Task | None = None

    def last_output(self, lines: int = 20) -> str:
        return "\n".join(list(self.output)[-lines:])

    def report(self) -> dict:
        return {"shard_id": self.shard_id, "replica_id": self.replica_id, "state": self.state, "port": self.port}


class Agent:
    """The agent of one node; `await run()` until shutdown or rejection."""

    def __init__(
        self,
        control_planes: list[str],
        node: str,
        token: str,
        gpus: list[GPUInfo],
        address: str,
        fabric: str = "",
        labels: dict | None = None,
        heartbeat_seconds: float = 5.0,
        engine_python: str = sys.executable,
        health_timeout: float = 600.0,
        stop_grace_seconds: float = STOP_GRACE_SECONDS,
    ):
        if not control_planes:
            raise ValueError("an agent needs at least one control-plane address")
        for uri in control_planes:
            if not uri.startswith(("ws://", "wss://")):
                raise ValueError(f"control-plane address {uri!r} must start with ws:// or wss://")
        if not node:
            raise ValueError("an agent needs a node name")
        if not token:
            raise ValueError("an agent needs its node credential (token)")
        if heartbeat_seconds <= 0:
            raise ValueError(f"heartbeat interval must be positive, got {heartbeat_seconds}")
        self.control_planes = list(control_planes)
        self.node = node
        self.token = token
        self.gpus = list(gpus)
        self.address = address
        self.fabric = fabric
        self.labels = dict(labels or {})
        self.heartbeat_seconds = heartbeat_seconds
        self.engine_python = engine_python
        self.health_timeout = health_timeout
        self.stop_grace_seconds = stop_grace_seconds
        self.highest_epoch: int | None = None
        self._shards: dict[int, Shard] = {}
        self._ws: ClientConnection | None = None
        self._send_lock: asyncio.Lock | None = None
        self._closing: asyncio.Event | None = None
        self._shutdown_task: asyncio.Task | None = None

    # -- public ----------------------------------------------------------------
    async def run(self) -> None:
        """Hold the control-plane stream until shutdown(); raise AgentRejected if refused.

        Connection losses are retried with backoff, rotating through the
        control-plane addresses. Engines started here are stopped when run()
        returns or raises, so none outlive the agent that answers for them.
        """
        self._ensure_primitives()
        try:
            await self._run_loop()
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        """Stop every engine (SIGTERM, then SIGKILL after the grace) and close the stream.

        Safe to call twice, concurrently, or from a task a signal handler spawned.
        """
        self._ensure_primitives()
        self._closing.set()
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown())
        await asyncio.shield(self._shutdown_task)

    def running_shards(self) -> list[dict]:
        """The shards this agent runs now, as `hello` reports them."""
        return [shard.report() for shard in self._shards.values()]

    def engine_pid(self, shard_id: int) -> int | None:
        """The process id of a running shard's engine, or None."""
        shard = self._shards.get(shard_id)
        return shard.process.pid if shard else None

    # -- connection ----------------------------------------------------------------
    def _ensure_primitives(self):
        # Created lazily: asyncio objects belong to the loop that runs the agent.
        if self._closing is None:
            self._closing = asyncio.Event()
            self._send_lock = asyncio.Lock()

    async def _run_loop(self) -> None:
        failures = 0
        turn = 0
        while not self._closing.is_set():
            uri = self.control_planes[turn % len(self.control_planes)]
            try:
                ws = await self._connect(uri)
                if ws is None:
                    return
                failures = 0
                await self._session(ws, uri)
            except InvalidStatus as exc:
                status = exc.response.status_code
                if status in (401, 403):
                    raise AgentRejected(
                        f"control plane {uri} refused node “{self.node}” (HTTP {status}): "
                        "its credential is wrong or revoked; enrol the node again"
                    ) from None
                log.warning("control plane %s answered HTTP %s to the agent handshake", uri, status)
            except InvalidURI as exc:
                raise ValueError(f"control-plane address {uri!r} is not a WebSocket URI: {exc}") from None
            except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed) as exc:
                if isinstance(exc, ConnectionClosed):
                    self._check_close(exc.rcvd.code if exc.rcvd else None, uri)
                log.warning("control plane %s unreachable or lost: %s", uri, exc or type(exc).__name__)
            if self._closing.is_set():
                return
            turn += 1
            delay = min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2 ** min(failures, 16))
            failures += 1
            # Jitter keeps a fleet that lost its control plane from reconnecting in lockstep.
            delay *= random.uniform(0.8, 1.2)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), delay)

    async def _connect(self, uri: str) -> ClientConnection | None:
        """Open the stream, or return None if shutdown() comes first."""
        headers = {"Authorization": f"Bearer {self.token}", "X-Llmgw-Node": self.node}
        opening = asyncio.ensure_future(
            connect(uri, additional_headers=headers, proxy=None, open_timeout=10, close_timeout=5)
        )
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({opening, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
        if not opening.done():
            opening.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await opening
            return None
        ws = opening.result()
        if self._closing.is_set():
            await ws.close()
            return None
        return ws

    def _check_close(self, code: int | None, uri: str) -> None:
        if code == protocol.CLOSE_UNAUTHORIZED:
            raise AgentRejected(f"control plane {uri} closed the stream: node “{self.node}” is not authorised")
        if code == protocol.CLOSE_SUPERSEDED:
            raise AgentSuperseded(
                f"control plane {uri} closed the stream: another agent connected as node “{self.node}”; "
                "this one stops so the two do not fight over the node's engines"
            )

    async def _session(self, ws: ClientConnection, uri: str) -> None:
        self._ws = ws
        heartbeat = asyncio.create_task(self._heartbeats(ws), name=f"agent-{self.node}-heartbeat")
        try:
            await self._send(self._hello())
            log.info("agent %s connected to %s", self.node, uri)
            async for raw in ws:
                await self._receive(raw)
            # A clean close by the peer ends the iteration without raising.
            if not self._closing.is_set():
                self._check_close(ws.close_code, uri)
                log.warning("control plane closed the stream (code %s)", ws.close_code)
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
            self._ws = None

    async def _heartbeats(self, ws: ClientConnection) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_seconds)
            await self._send(
                {
                    "type": protocol.HEARTBEAT,
                    "v": protocol.PROTOCOL_VERSION,
                    "gpus": [{"index": g.index, "healthy": g.healthy} for g in self.gpus],
                    "shards": [{"shard_id": s.shard_id, "state": s.state} for s in self._shards.values()],
                },
                ws,
            )

    def _hello(self) -> dict:
        return {
            "type": protocol.HELLO,
            "v": protocol.PROTOCOL_VERSION,
            "node": self.node,
            "version": AGENT_VERSION,
            "address": self.address,
            "fabric": self.fabric,
            "labels": self.labels,
            "gpus": [g.to_message() for g in self.gpus],
            "shards": self.running_shards(),
        }

    async def _send(self, message: dict, ws: ClientConnection | None = None) -> bool:
        """Send on the current stream; a lost message is fine, `hello` re-reports on reconnect."""
        ws = ws or self._ws
        if ws is None:
            log.debug("not connected; dropped %s", message.get("type"))
            return False
        try:
            async with self._send_lock:
                await ws.send(json.dumps(message))
        except ConnectionClosed:
            return False
        return True

    async def _report(self, shard_id: int, state: str, message: str = "", port: int | None = None) -> None:
        log.info("shard %s on %s: %s%s", shard_id, self.node, state, f" ({message.splitlines()[-1]})" if message else "")
        await self._send(
            {
                "type": protocol.SHARD_STATUS,
                "v": protocol.PROTOCOL_VERSION,
                "shard_id": shard_id,
                "state": state,
                "message": message,
                "port": port,
            }
        )

    # -- commands ----------------------------------------------------------------
    async def _receive(self, raw) -> None:
        try:
            message = json.loads(raw)
        except (ValueError, TypeError):
            log.warning("control plane sent a frame that is not JSON; ignored")
            return
        if not isinstance(message, dict):
            log.warning("control plane sent a message that is not an object; ignored")
            return
        kind = message.get("type")
        if kind == protocol.ERROR:
            log.error("control plane reported an error: %s", message.get("message", "(no message)"))
            return
        if kind not in (protocol.START_SHARD, protocol.STOP_SHARD, protocol.DRAIN_SHARD):
            log.warning("control plane sent unknown message type %r; ignored", kind)
            return
        epoch, shard_id = message.get("epoch"), message.get("shard_id")
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            log.warning("%s without an integer epoch refused", kind)
            return
        if isinstance(shard_id, bool) or not isinstance(shard_id, int):
            log.warning("%s without an integer shard_id refused", kind)
            return
        # Fencing (DESIGN invariant 1): a leader older than one we have heard from may act on stale beliefs.
        if self.highest_epoch is not None and epoch < self.highest_epoch:
            log.warning(
                "%s for shard %s refused: epoch %s is older than epoch %s already seen",
                kind, shard_id, epoch, self.highest_epoch,
            )
            return
        self.highest_epoch = epoch
        if kind == protocol.START_SHARD:
            await self._start_shard(message)
        else:
            # For now draining is stopping: engines are stopped with SIGTERM, which
            # vLLM and SGLang treat as "finish in-flight requests, then exit".
            self._begin_stop(shard_id)

    async def _start_shard(self, cmd: dict) -> None:
        shard_id = cmd["shard_id"]
        running = self._shards.get(shard_id)
        if running is not None:
            # A resent start (the control plane had no answer yet): answer, do not start twice.
            await self._report(shard_id, running.state, port=running.port if running.state == "ready" else None)
            return
        try:
            launch = self._launch_for(cmd)
        except (KeyError, TypeError, ValueError) as exc:
            message = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            await self._report(shard_id, "failed", f"cannot start shard: {message}")
            return
        port = cmd["port"]
        if _port_in_use(port):
            await self._report(shard_id, "failed", f"cannot start shard: port {port} is already in use on this node")
            return
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in (cmd.get("env") or {}).items()})
        env.update(launch.env)  # the assigned GPUs always win over a profile's environment
        try:
            process = await asyncio.create_subprocess_exec(
                *launch.argv,
                env=env,
                cwd=launch.cwd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                preexec_fn=_die_with_parent_preexec(),
                # Its own process group, so a stop reaches the engine's workers too.
                start_new_session=True,
            )
        except OSError as exc:
            await self._report(shard_id, "failed", f"cannot run {launch.argv[0]}: {exc.strerror or exc}")
            return
        replica_id = cmd.get("replica_id")
        shard = Shard(shard_id, replica_id if isinstance(replica_id, int) else None, port, cmd["engine"], launch, process)
        self._shards[shard_id] = shard
        log.info("shard %s: started %s (pid %s)", shard_id, " ".join(launch.argv), process.pid)
        await self._report(shard_id, "starting")
        shard.tasks.append(asyncio.create_task(self._collect_output(shard), name=f"shard-{shard_id}-output"))
        shard.tasks.append(asyncio.create_task(self._watch(shard), name=f"shard-{shard_id}-watch"))

    def _launch_for(self, cmd: dict) -> Launch:
        indices = cmd["gpu_indices"]
        known = {g.index for g in self.gpus}
        if isinstance(indices, list):
            missing = [i for i in indices if i not in known]
            if missing:
                raise ValueError(f"GPU indices {missing} are not on node {self.node}")
        env = cmd.get("env") or {}
        if not isinstance(env, dict):
            raise ValueError("field “env” must be an object")
        return build_launch(
            cmd["engine"],
            model=cmd["model"],
            source=cmd["source"],
            port=cmd["port"],
            gpu_indices=indices,
            rank=cmd.get("rank", 0),
            node_count=cmd.get("node_count", 1),
            head_address=cmd.get("head_address") or "",
            args=cmd.get("args") or [],
            python=self.engine_python,
        )

    async def _collect_output(self, shard: Shard) -> None:
        # Bounded: only the last lines are kept, for failure messages.
        stream = shard.process.stdout
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line longer than the stream limit: keep going with the next
                continue
            if not line:
                return
            shard.output.append(line.decode("utf-8", "replace").rstrip())

    async def _watch(self, shard: Shard) -> None:
        """Report ready when the engine is healthy, failed if it exits or never becomes healthy."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.health_timeout
        started = loop.time()
        url = f"http://127.0.0.1:{shard.port}{shard.launch.health_path or ''}"
        interval = 0.05
        exited = asyncio.ensure_future(shard.process.wait())
        async with httpx.AsyncClient(trust_env=False, timeout=2.0) as client:
            while shard.process.returncode is None and shard.state == "starting" and not shard.stopping:
                if shard.launch.health_path is None:
                    healthy = loop.time() - started >= NO_HTTP_SETTLE_SECONDS
                else:
                    try:
                        healthy = (await client.get(url)).status_code == 200
                    except httpx.HTTPError:
                        healthy = False
                if healthy and shard.process.returncode is None:
                    shard.state = "ready"
                    await self._report(shard.shard_id, "ready", port=shard.port)
                    break
                if loop.time() >= deadline:
                    await self._fail(shard, f"engine did not become healthy within {self.health_timeout:g} s")
                    return
                await asyncio.wait({exited}, timeout=interval)
                interval = min(1.0, interval * 1.5)
        code = await exited
        if shard.stopping:
            return
        # Let the output reader drain the pipe so the message carries the engine's last words.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(shard.tasks[0]), 1.0)
        self._shards.pop(shard.shard_id, None)
        tail = shard.last_output()
        await self._report(
            shard.shard_id, "failed", f"engine exited with code {code}" + (f":\n{tail}" if tail else "")
        )

    async def _fail(self, shard: Shard, reason: str) -> None:
        shard.stopping = True
        await self._terminate(shard)
        self._shards.pop(shard.shard_id, None)
        tail = shard.last_output()
        await self._report(shard.shard_id, "failed", reason + (f":\n{tail}" if tail else ""))

    def _begin_stop(self, shard_id: int) -> asyncio.Task:
        shard = self._shards.get(shard_id)
        if shard is None:
            # Nothing runs under that id: say so, so the control plane can let go of it.
            return asyncio.create_task(self._report(shard_id, "stopped", "no engine was running for this shard"))
        if shard.stop_task is None:
            shard.stopping = True
            shard.stop_task = asyncio.create_task(self._stop(shard), name=f"shard-{shard_id}-stop")
        return shard.stop_task

    async def _stop(self, shard: Shard) -> None:
        code = await self._terminate(shard)
        self._shards.pop(shard.shard_id, None)
        await self._report(shard.shard_id, "stopped", f"engine exited with code {code}")

    async def _terminate(self, shard: Shard) -> int:
        """SIGTERM the engine's process group, SIGKILL it after the grace; return the exit code."""
        process = shard.process
        if process.returncode is None:
            self._signal(process, signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(process.wait()), self.stop_grace_seconds)
            except TimeoutError:
                log.warning("shard %s ignored SIGTERM for %g s; killing it", shard.shard_id, self.stop_grace_seconds)
        # Workers the engine left behind in its group are killed too.
        self._signal(process, signal.SIGKILL)
        code = await process.wait()
        for task in shard.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        return code

    @staticmethod
    def _signal(process: asyncio.subprocess.Process, sig: int) -> None:
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(sig)

    async def _shutdown(self) -> None:
        stops = [self._begin_stop(shard_id) for shard_id in list(self._shards)]
        if stops:
            await asyncio.gather(*stops, return_exceptions=True)
        ws = self._ws
        if ws is not None:
            with contextlib.suppress(Exception):
                await ws.close()
