"""The node agent: carries out the control plane's commands and reports what its engines do.

One `Agent` per node. Over its link (agent/link.py) it says `hello` (its GPUs
and the shards it runs now), sends a `heartbeat` on an interval, and carries
out `start_shard`, `stop_shard` and `drain_shard`, answering each with
`shard_status` (messages in nodewire/protocol.py), `sleep_shard` and `wake_shard`
through agent/hibernation.py, and `load_adapter` and `unload_adapter` through
agent/adapters.py. Each shard's engine is an EngineProcess (agent/supervisor.py) started from its launch (agent/engines/launch.py).

Each heartbeat carries the requests every serving engine holds, read from its
/metrics just before (agent/engines/load.py, bounded so a slow engine cannot
hold the heartbeat back). A drain waits for those to reach zero, or for its
timeout, before the engine is stopped (agent/draining.py).

Each heartbeat also carries every GPU's health, read again just before
(agent/gpus/health.py, bounded the same way). Hello and, when they change,
heartbeats report the weights under the weights root (agent/weights/inventory.py);
`remove_weights` deletes one source's weights there, off the command path,
and is answered with `weights_status`; `stage_weights` fetches or checks a
source's weights there before an engine needs them (agent/weights/staging.py),
answered with `staging_status` as it goes, copying from the peers it names;
with a weights port, the agent's weights server lets the peers the control
plane allows with `serve_weights` copy its weights (agent/weights/peer_server.py).
Given a state directory (agent/state.py), the agent remembers the highest
leader epoch it has obeyed across restarts, and is bound to one node name.

The Agent installs no signal handlers, so several can run as tasks in one
event loop (`manage.py up`); whoever owns the loop calls `shutdown()`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
from collections.abc import Callable
from typing import TypeVar

import msgspec

from agent import draining
from agent.adapters import Adapters
from agent.engines.load import EngineLoad
from agent.gpus.discovery import host_memory_mib
from agent.gpus.health import (
    GPUCondition,
    HealthMonitor,
    HealthReader,
    SimulatedHealth,
    gpu_health_reports,
    gpu_reports,
)
from agent.hibernation import Hibernation
from agent.link import ControlPlaneLink
from agent.options import AgentOptions
from agent.starting import added_env, launch_for
from agent.state import AgentState, Fence
from agent.supervisor import SERVING_STATES, EngineProcess, Readiness, Shard, port_in_use
from agent.weights.inventory import WeightsInventory
from agent.weights.peer_server import PeerServer
from agent.weights.staging import Staging
from nodewire import engine_env, protocol

__all__ = ["Agent"]

log = logging.getLogger(__name__)

AGENT_VERSION = "0.1.0"
_Refusable = TypeVar(
    "_Refusable", bound=protocol.SleepShard | protocol.WakeShard | protocol.LoadAdapter | protocol.UnloadAdapter
)


class Agent:
    """The agent of one node; `await run()` until shutdown or rejection."""

    def __init__(self, options: AgentOptions, health: HealthReader | None = None):
        """`health` reads the GPUs' health before each heartbeat; None simulates it (fake GPUs, tests).

        StateError if `options.state_dir` cannot be used; ValueError if the link refuses the options.
        """
        self.options = options
        self._state = AgentState.open(options.state_dir, options.node) if options.state_dir is not None else None
        self._link = ControlPlaneLink(
            list(options.control_planes),
            options.node,
            options.token,
            options.heartbeat_seconds,
            options.ca_file,
            options.cert_file,
            options.key_file,
        )
        self.control_planes = self._link.control_planes
        self.node = options.node
        self.gpus = list(options.gpus)
        self._load = EngineLoad(options.load_timeout)
        self._fencing = Fence(self._state)
        self._shards: dict[int, Shard] = {}
        self._hibernation = Hibernation(
            self._shards, self._load, self._report, options.drain_poll_seconds, options.stop_grace_seconds
        )
        self._adapters = Adapters(self._shards, self._link.send)
        self._shutdown_task: asyncio.Task | None = None
        discovered = {
            g.index: GPUCondition(g.healthy, "" if g.healthy else "unreadable at discovery") for g in self.gpus
        }
        # Fake GPUs (and tests) get a health that set_gpu_health can change.
        self._health = HealthMonitor(health or SimulatedHealth(discovered), discovered)
        self._weights = WeightsInventory(options.weights_root, options.weights_scan_every)
        self._staging = Staging(
            options.weights_root,
            self._link.send,
            self._weights.changed,
            hub_endpoint=options.hub_endpoint,
            budget=options.weights_budget,
        )
        self._weights.staging = self._staging.fetching
        self._peers = (
            PeerServer(options.weights_root, self._staging.plan_of, options.weights_bind, options.weights_port)
            if options.weights_root is not None and options.weights_port is not None
            else None
        )

    async def run(self) -> None:
        """Hold the control-plane stream until shutdown(); raise AgentRejected if refused.

        Engines started here are stopped when run() returns or raises, so none
        outlive the agent that answers for them.
        """
        try:
            await self._weights.scan_now()
            if self._peers is not None:
                await self._peers.start()
            await self._link.run(self._hello, self._heartbeat, self._receive)
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        """Stop every engine (SIGTERM, then SIGKILL after the grace) and close the stream.

        Safe to call twice, concurrently, or from a task a signal handler spawned.
        """
        self._link.closing.set()
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown())
        await asyncio.shield(self._shutdown_task)

    def running_shards(self) -> list[dict]:
        """The shards this agent runs now, as `hello` reports them."""
        return [protocol.to_builtins(shard.report()) for shard in self._shards.values()]

    def engine_pid(self, shard_id: int) -> int | None:
        """The process id of a running shard's engine, or None."""
        shard = self._shards.get(shard_id)
        return shard.engine.pid if shard else None

    def set_gpu_health(self, index: int, healthy: bool, reason: str = "") -> None:
        """Simulate a GPU turning (un)healthy; the next heartbeat reports it. Only for simulated health."""
        reader = self._health.reader
        if not isinstance(reader, SimulatedHealth):
            raise RuntimeError("GPU health can be set only on an agent with simulated GPUs")
        reader.set(index, healthy, reason)
        self._health.last.update(reader.read())

    def _hello(self) -> bytes:
        return protocol.encode(
            protocol.Hello(
                node=self.node,
                version=AGENT_VERSION,
                address=self.options.address,
                fabric=self.options.fabric,
                labels=dict(self.options.labels),
                gpus=gpu_reports(self.gpus, self._health.last),
                shards=[shard.report() for shard in self._shards.values()],
                weights=self._weights.for_hello(),
                host_memory_mib=msgspec.UNSET if (memory := host_memory_mib()) is None else memory,
                weights_port=msgspec.UNSET if self._peers is None else self._peers.port,
            )
        )

    async def _heartbeat(self) -> bytes:
        serving = {
            s.shard_id: (s.port, s.launch.metrics_path, s.launch.url_host)
            for s in self._shards.values()
            if s.state in SERVING_STATES
        }
        running, health = await asyncio.gather(self._load.read_many(serving), self._health.read())
        # Shards that started or stopped while the engines were read are reported as they are now.
        shards = [s.heartbeat(running.get(s.shard_id)) for s in self._shards.values()]
        gpus = gpu_health_reports(self.gpus, health)
        return protocol.encode(protocol.Heartbeat(gpus=gpus, shards=shards, weights=self._weights.for_heartbeat()))

    async def _report(
        self,
        shard_id: int,
        state: protocol.ShardState,
        message: str = "",
        port: int | None = None,
        port_busy: bool = False,
        seconds: float | None = None,
        sleep_level: protocol.SleepLevel | None = None,
    ):
        took = f" in {seconds:g} s" if seconds is not None else ""
        last = f" ({message.splitlines()[-1]})" if message else ""
        log.info("shard %s on %s: %s%s%s", shard_id, self.node, state, took, last)
        status = protocol.ShardStatus(
            shard_id=shard_id, state=state, message=message, port=port, port_busy=port_busy, seconds=seconds,
            sleep_level=sleep_level,
        )  # fmt: skip
        if not await self._link.send(protocol.encode(status)):
            log.debug("not connected; dropped shard_status for shard %s", shard_id)

    async def _receive(self, raw: str | bytes) -> None:
        try:
            message = protocol.decode_command(raw)
        except protocol.ProtocolError as exc:
            await self._refuse(exc)
            return
        if isinstance(message, protocol.Error):
            log.error("control plane reported an error: %s", message.message)
            return
        subject = (
            f"weights {message.source}"
            if isinstance(message, protocol.RemoveWeights | protocol.StageWeights | protocol.ServeWeights)
            else message.shard_id
        )
        if not self._fencing.admits(str(message.__struct_config__.tag), message.epoch, subject):
            await self._ack(message.cid, f"epoch {message.epoch} is older than epoch {self.highest_epoch} already seen")
            return
        if isinstance(message, protocol.SleepShard | protocol.WakeShard):
            await self._refuse_or_begin(message, self._hibernation.refusal(message), self._hibernation.begin)
            return
        if isinstance(message, protocol.LoadAdapter | protocol.UnloadAdapter):
            await self._refuse_or_begin(message, self._adapters.refusal(message), self._adapters.begin)
            return
        # Answered before it is carried out: the control plane stops re-sending it now, and a re-sent
        # copy is answered again (a start for a shard already running is not started twice).
        await self._ack(message.cid)
        if isinstance(message, protocol.RemoveWeights | protocol.StageWeights | protocol.ServeWeights):
            self._weights_command(message)
        elif isinstance(message, protocol.StartShard):
            await self._start_shard(message)
        elif isinstance(message, protocol.DrainShard):
            self._begin_drain(message.shard_id, message.timeout_seconds)
        else:
            self._begin_stop(message.shard_id)

    def _weights_command(self, message: protocol.RemoveWeights | protocol.StageWeights | protocol.ServeWeights) -> None:
        """Begin a command about the node's weights; each runs off the command path."""
        if isinstance(message, protocol.RemoveWeights):
            self._weights.start_removal(message, self._link.send)
        elif isinstance(message, protocol.StageWeights):
            self._staging.begin(message)
        elif self._peers is not None:
            self._peers.allow(message)
        else:
            log.warning("serve_weights for %s ignored: this agent runs no weights server", message.source)

    async def _refuse_or_begin(self, message: _Refusable, refused: str, begin: Callable[[_Refusable], object]) -> None:
        """Acknowledge a command, refused when it cannot be done (`refused` says why), and begin it when it can."""
        await self._ack(message.cid, refused)
        if refused:
            log.warning("refused %s for shard %s: %s", message.__struct_config__.tag, message.shard_id, refused)
        else:
            begin(message)

    @property
    def highest_epoch(self) -> int | None:
        """The newest leader epoch this agent has obeyed (remembered across restarts with a state directory)."""
        return self._fencing.highest_epoch

    async def _ack(self, cid: str | None, refused: str = "") -> None:
        """Acknowledge command `cid` (none: the command wants no answer); `refused` says why it is not carried out."""
        if not cid:
            return
        ack = protocol.Ack(cid=cid, refused=bool(refused), message=refused)
        if not await self._link.send(protocol.encode(ack)):
            log.debug("not connected; dropped ack for command %s (it will be sent again)", cid)

    async def _refuse(self, exc: protocol.ProtocolError) -> None:
        """Log a malformed message; answer a malformed start the control plane would otherwise wait on."""
        log.warning("control plane sent a message the agent cannot use: %s; ignored", exc)
        # Re-sending it would not make it well-formed: acknowledged as refused, with the reason.
        await self._ack(exc.cid, f"malformed command: {exc}")
        if exc.kind != protocol.START_SHARD or exc.epoch is None or exc.shard_id is None:
            return
        if not self._fencing.admits(exc.kind, exc.epoch, exc.shard_id):
            return
        running = self._shards.get(exc.shard_id)
        if running is not None:
            await self._answer_resent_start(running)
        else:
            await self._report(exc.shard_id, "failed", f"cannot start shard: {exc}")

    async def _answer_resent_start(self, shard: Shard) -> None:
        # The control plane resends a start it has no answer to yet: answer, do not start twice.
        if shard.state == "sleeping":
            await self._report(shard.shard_id, "sleeping", sleep_level=shard.sleep_level)
            return
        ready = shard.state == "ready"
        await self._report(shard.shard_id, "ready" if ready else "starting", port=shard.port if ready else None)

    async def _start_shard(self, cmd: protocol.StartShard) -> None:
        running = self._shards.get(cmd.shard_id)
        if running is not None:
            await self._answer_resent_start(running)
            return
        try:
            launch = launch_for(cmd, self.options, self.gpus)
        except ValueError as exc:
            await self._report(cmd.shard_id, "failed", f"cannot start shard: {exc}")
            return
        if port_in_use(cmd.port, launch.host):
            await self._report(
                cmd.shard_id,
                "failed",
                f"cannot start shard: port {cmd.port} is already in use on this node",
                port=cmd.port,
                port_busy=True,
            )
            return
        added = added_env(cmd, launch, self.options, self.gpus)
        env = {**os.environ, **added}
        try:
            # The name prefixes every line of the engine's output in the agent's log.
            engine = await EngineProcess.launch(
                launch.argv, env, launch.cwd, f"shard {cmd.shard_id} ({cmd.model} rank {cmd.rank})"
            )
        except OSError as exc:
            await self._report(cmd.shard_id, "failed", f"cannot run {launch.argv[0]}: {exc.strerror or exc}")
            return
        shard = Shard(cmd.shard_id, cmd.replica_id, cmd.port, launch, engine)
        self._shards[cmd.shard_id] = shard
        if cmd.node_count > 1:
            # The engine's argv may not say it (the mock's does not): where this rank meets the others.
            log.info(
                "shard %s: rank %s of %s, head %s, rendezvous port %s, port %s",
                cmd.shard_id, cmd.rank, cmd.node_count, cmd.head_address, cmd.rendezvous_port, cmd.port,
            )  # fmt: skip
        # Shell-quoted, so the line can be pasted into a shell to run the engine by hand (secrets masked:
        # the log is no place for a token, nodewire/engine_env.py).
        command_line = " ".join(filter(None, [engine_env.shown(added), shlex.join(launch.argv)]))
        log.info("shard %s: started %s (pid %s)", cmd.shard_id, command_line, engine.pid)
        await self._report(cmd.shard_id, "starting")
        shard.watch = asyncio.create_task(self._watch(shard), name=f"shard-{cmd.shard_id}-watch")

    async def _watch(self, shard: Shard) -> None:
        """Report ready when the engine is healthy, failed if it exits or never becomes healthy."""
        readiness = await shard.engine.wait_ready(
            shard.port, shard.launch.health_path, self.options.health_timeout, shard.launch.url_host
        )
        if shard.stopping:
            return
        if readiness is Readiness.TIMED_OUT:
            shard.stopping = True
            await shard.engine.terminate(self.options.stop_grace_seconds)
            self._shards.pop(shard.shard_id, None)
            await self._report_failed(shard, f"engine did not become healthy within {self.options.health_timeout:g} s")
            return
        if readiness is Readiness.READY:
            shard.state = "ready"
            self._weights.changed()  # the engine may have downloaded its weights
            await self._report(shard.shard_id, "ready", port=shard.port)
        code = await shard.engine.wait_exit()
        if shard.stopping:
            return
        self._shards.pop(shard.shard_id, None)
        await self._report_failed(shard, f"engine exited with code {code}")

    async def _report_failed(self, shard: Shard, reason: str) -> None:
        tail = shard.engine.last_output()
        await self._report(shard.shard_id, "failed", reason + (f":\n{tail}" if tail else ""))

    def _begin_stop(self, shard_id: int) -> asyncio.Task:
        """Stop a shard's engine now; a drain under way ends at once and stops it."""
        shard = self._shards.get(shard_id)
        if shard is None:
            return self._report_not_running(shard_id)
        shard.stop_now.set()
        if shard.stop_task is None:
            shard.stopping = True
            shard.stop_task = asyncio.create_task(self._stop(shard), name=f"shard-{shard_id}-stop")
        return shard.stop_task

    def _begin_drain(self, shard_id: int, timeout: float) -> asyncio.Task:
        """Stop a shard's engine once it holds no requests, or after `timeout` s; a repeat changes nothing."""
        shard = self._shards.get(shard_id)
        if shard is None:
            return self._report_not_running(shard_id)
        if shard.stop_task is not None:
            return shard.stop_task
        shard.stopping = True
        if shard.state not in ("ready", "falling_asleep"):
            # Not serving (yet, or while asleep), so nothing is in flight.
            reason = f"stopped at once: the engine was {_NOT_SERVING.get(shard.state, 'not serving yet')}"
        elif shard.launch.metrics_path is None:
            # Only a rank above 0 reports no load, and it holds no requests of its own: the control plane
            # drains its head first and drains it only once the head has stopped (reconciler/lifecycle/transitions.py).
            reason = "stopped at once: the engine reports no load to wait on"
        else:
            shard.state = "draining"
            shard.stop_task = asyncio.create_task(self._drain(shard, timeout), name=f"shard-{shard_id}-drain")
            return shard.stop_task
        shard.stop_task = asyncio.create_task(self._stop(shard, reason), name=f"shard-{shard_id}-stop")
        return shard.stop_task

    def _report_not_running(self, shard_id: int) -> asyncio.Task:
        # Nothing runs under that id: say so, so the control plane can let go of it.
        return asyncio.create_task(self._report(shard_id, "stopped", "no engine was running for this shard"))

    async def _drain(self, shard: Shard, timeout: float) -> None:
        log.info("shard %s: draining (up to %g s)", shard.shard_id, timeout)
        reason = await draining.wait_until_idle(
            lambda: self._load.read(shard.port, shard.launch.metrics_path, shard.launch.url_host),
            timeout,
            shard.stop_now,
            lambda: shard.engine.running,
            self.options.drain_poll_seconds,
        )
        await self._stop(shard, reason)

    async def _stop(self, shard: Shard, reason: str = "") -> None:
        code = await shard.engine.terminate(self.options.stop_grace_seconds)
        if shard.watch is not None:
            shard.watch.cancel()
        self._shards.pop(shard.shard_id, None)
        self._weights.changed()
        exited = f"engine exited with code {code}"
        await self._report(shard.shard_id, "stopped", f"{reason}; {exited}" if reason else exited)

    async def _shutdown(self) -> None:
        await self._staging.cancel_all()
        if self._peers is not None:
            await self._peers.stop()
        stops = [self._begin_stop(shard_id) for shard_id in list(self._shards)]
        if stops:
            await asyncio.gather(*stops, return_exceptions=True)
        await self._link.close()
        await self._load.aclose()
        await self._hibernation.aclose()
        await self._adapters.aclose()


# What a drain says of an engine it stops at once because it serves nothing.
_NOT_SERVING = {"sleeping": "asleep", "waking": "waking from sleep"}
