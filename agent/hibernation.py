"""Sleep and wake of one node's shards: `sleep_shard` and `wake_shard` (nodewire/protocol.py) carried out.

A sleep is a drain that ends in sleep instead of a stop (DESIGN "Stopping is always a drain"): the control
plane has unpublished the replica, the agent waits until the engine reports no requests in flight (or the
timeout; agent/draining.py), then asks the engine to sleep and confirms it (agent/engines/sleep.py). A wake
asks the engine to wake, reloads what its sleep level discarded, and confirms it serves. Each reports a
`shard_status` (`sleeping`, or `ready` with its port) with how long it took; one that fails reports
`failed`, naming the call, and the engine is stopped, as a failed start is.

A shard's states, as heartbeats and hello report them: ready → falling_asleep → sleeping → waking → ready.
What cannot be done is refused in the ack, with the reason: a shard not running, an engine that cannot
sleep, a level its engine lacks, and a state the command does not fit (a sleep for a shard still starting
or waking, a wake for one going to sleep). A command re-sent for what is already done or under way is
answered again, or waits for the answer under way.

Races with a stop or a drain of the same shard: the stop wins. A stop ends the wait for requests in flight
at once, and a sleep or wake under way reports nothing more (the stop reports `stopped`); a drain of a shard
going to sleep takes over its wait (the engine is stopped, not put to sleep, once idle), and a drain of a
sleeping or waking shard stops it at once: it holds nothing in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import httpx

from agent import draining
from agent.engines.load import EngineLoad
from agent.engines.sleep import EngineSleep, EngineSleepError, level_problem
from agent.supervisor import Shard
from nodewire import protocol

log = logging.getLogger(__name__)

Report = Callable[..., Coroutine[Any, Any, None]]


class Hibernation:
    """Carries out sleep and wake commands on the shards an Agent runs (`shards`, shared with it)."""

    def __init__(
        self,
        shards: dict[int, Shard],
        load: EngineLoad,
        report: Report,
        poll_seconds: float = draining.DRAIN_POLL_SECONDS,
        stop_grace_seconds: float = 10.0,
    ):
        self._shards = shards
        self._load = load
        self._report = report
        self._poll_seconds = poll_seconds
        self._stop_grace = stop_grace_seconds
        self._client = httpx.AsyncClient(trust_env=False)

    def refusal(self, cmd: protocol.SleepShard | protocol.WakeShard) -> str:
        """Why `cmd` cannot be carried out now ("" when it can, or is already done or under way)."""
        shard = self._shards.get(cmd.shard_id)
        if shard is None:
            return f"shard {cmd.shard_id} is not running on this node"
        if shard.launch.sleep is None:
            return shard.launch.no_sleep
        if shard.stopping:
            return f"shard {cmd.shard_id} is stopping"
        if isinstance(cmd, protocol.SleepShard):
            return self._sleep_refusal(shard, cmd.level)
        return _WAKE_REFUSALS.get(shard.state, "").format(shard=cmd.shard_id)

    def _sleep_refusal(self, shard: Shard, level: int) -> str:
        problem = level_problem(shard.launch.sleep or "", level)
        if problem is not None:
            return problem
        if shard.state == "sleeping" and shard.sleep_level != level:
            return f"shard {shard.shard_id} already sleeps at level {shard.sleep_level}; wake it first"
        return _SLEEP_REFUSALS.get(shard.state, "").format(shard=shard.shard_id)

    def begin(self, cmd: protocol.SleepShard | protocol.WakeShard) -> asyncio.Task | None:
        """Start what `cmd` asks (after `refusal` found nothing); None when it is done or under way already."""
        shard = self._shards[cmd.shard_id]
        started = asyncio.get_running_loop().time()
        if isinstance(cmd, protocol.SleepShard):
            if shard.state == "sleeping":
                return self._answer_again(shard, "sleeping")
            if shard.state != "ready":
                return None  # going to sleep already: its report answers this copy too
            shard.state = "falling_asleep"
            coro: Any = self._sleep(shard, cmd.level, cmd.timeout_seconds, started)
        else:
            if shard.state == "ready":
                return self._answer_again(shard, "ready")
            if shard.state != "sleeping":
                return None
            shard.state = "waking"
            coro = self._wake(shard, started)
        shard.sleep_task = asyncio.create_task(coro, name=f"shard-{shard.shard_id}-{shard.state}")
        return shard.sleep_task

    async def aclose(self) -> None:
        await self._client.aclose()

    def _answer_again(self, shard: Shard, state: str) -> asyncio.Task:
        # A copy of a command already carried out (its answer may have been lost): answer it again.
        if state == "sleeping":
            report = self._report(shard.shard_id, "sleeping", sleep_level=shard.sleep_level)
        else:
            report = self._report(shard.shard_id, "ready", port=shard.port)
        return asyncio.create_task(report)

    def _engine(self, shard: Shard) -> EngineSleep:
        return EngineSleep(self._client, f"http://{shard.launch.url_host}:{shard.port}", shard.launch.sleep or "")

    def _current(self, shard: Shard) -> bool:
        """Whether `shard` is still this agent's to act on: not stopping, not exited (the watch reports that)."""
        return not shard.stopping and shard.engine.running and self._shards.get(shard.shard_id) is shard

    async def _sleep(self, shard: Shard, level: protocol.SleepLevel, timeout: float, started: float) -> None:
        log.info("shard %s: going to sleep at level %s (waiting up to %g s for requests in flight)", shard.shard_id,
                 level, timeout)  # fmt: skip
        waited = ""
        if shard.launch.metrics_path is not None:
            waited = await draining.wait_until_idle(
                lambda: self._load.read(shard.port, shard.launch.metrics_path, shard.launch.url_host),
                timeout,
                shard.stop_now,
                lambda: shard.engine.running,
                self._poll_seconds,
            )
        if not self._current(shard):
            return
        try:
            # Past the timeout the sleep does not wait any longer for what is still running.
            await self._engine(shard).sleep(level, cut_in_flight=waited not in ("", draining.DRAINED))
        except EngineSleepError as exc:
            await self._fail(shard, f"sleep at level {level} failed: {exc}")
            return
        await self._done(shard, "sleeping", level, started, message=waited, sleep_level=level)

    async def _wake(self, shard: Shard, started: float) -> None:
        level = shard.sleep_level or 1
        try:
            await self._engine(shard).wake(level)
        except EngineSleepError as exc:
            await self._fail(shard, f"wake from level {level} failed: {exc}")
            return
        await self._done(shard, "ready", None, started, port=shard.port)

    async def _done(
        self, shard: Shard, state: str, level: protocol.SleepLevel | None, started: float, **report: Any
    ) -> None:
        """Record a sleep or a wake carried out, and report it with the seconds it took, unless a stop came first."""
        if not self._current(shard):
            return
        shard.state, shard.sleep_level = state, level
        took = asyncio.get_running_loop().time() - started
        await self._report(shard.shard_id, state, seconds=round(took, 3), **report)

    async def _fail(self, shard: Shard, reason: str) -> None:
        """Stop the engine of a sleep or wake that failed and report it failed, unless a stop got there first."""
        if not self._current(shard):
            return
        shard.stopping = True
        await shard.engine.terminate(self._stop_grace)
        self._shards.pop(shard.shard_id, None)
        await self._report(shard.shard_id, "failed", f"{reason}; the engine was stopped")


# Why a command does not fit a shard's state ("" or absent: it fits, or is done or under way already).
_SLEEP_REFUSALS = {
    "starting": "shard {shard} is still starting; it can sleep once ready",
    "waking": "shard {shard} is waking; it can sleep once ready",
}
_WAKE_REFUSALS = {
    "starting": "shard {shard} is starting, not sleeping",
    "falling_asleep": "shard {shard} is going to sleep; wake it once it reports sleeping",
}
