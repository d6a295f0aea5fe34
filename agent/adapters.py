"""LoRA adapters on one node's shards: `load_adapter` and `unload_adapter` (nodewire/adapter_messages.py) carried out.

Each is fenced by epoch and acknowledged at once like every command (agent/runtime.py); what cannot be done
is refused in the ack, with the reason: a shard not running, one whose engine was started without adapter
slots (or cannot load at run time: llama.cpp), and one not ready (starting, draining, going to sleep, asleep,
waking). Then the agent asks the engine (agent/engines/adapters.py) and reports an `adapter_status`: `loaded`
with the seconds the load took, `unloaded`, or `failed` with the engine's own words.

One shard's adapter commands run one at a time, in the order they came: on a full engine an unload must have
freed its slot before the load that follows it asks for one. Different shards' run side by side, and none
holds up the agent's loop. A command whose turn comes when its shard is no longer ready (a sleep or a stop
came in between) reports `failed`, saying so.

Each Shard keeps the names its engine holds (`Shard.adapters`): what was loaded and not unloaded since the
engine started. A restarted engine is a new Shard, holding none. Heartbeats report them for every shard
whose engine takes adapters (`Shard.heartbeat`), so the control plane corrects what it believes after a lost
report or an engine restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httpx

from agent.engines.adapters import EngineAdapterError, EngineAdapters
from agent.supervisor import Shard
from nodewire import adapter_messages, protocol
from nodewire.adapter_messages import AdapterState

log = logging.getLogger(__name__)

Send = Callable[[bytes], Awaitable[bool]]
AdapterCommand = adapter_messages.LoadAdapter | adapter_messages.UnloadAdapter


class Adapters:
    """Carries out adapter commands on the shards an Agent runs (`shards`, shared with it); `send` sends a frame."""

    def __init__(self, shards: dict[int, Shard], send: Send):
        self._shards = shards
        self._send = send
        self._client = httpx.AsyncClient(trust_env=False)
        self._tasks: set[asyncio.Task] = set()

    def refusal(self, cmd: AdapterCommand) -> str:
        """Why `cmd` cannot be carried out now ("" when it can)."""
        shard = self._shards.get(cmd.shard_id)
        if shard is None:
            return f"shard {cmd.shard_id} is not running on this node"
        if shard.launch.adapters is None:
            return shard.launch.no_adapters
        return _not_ready(shard)

    def begin(self, cmd: AdapterCommand) -> asyncio.Task:
        """Queue `cmd` (after `refusal` found nothing) behind the shard's adapter commands under way."""
        shard = self._shards.get(cmd.shard_id)
        previous = shard.adapter_task if shard is not None else None
        kind = cmd.__struct_config__.tag
        task = asyncio.create_task(self._carry_out(cmd, previous), name=f"shard-{cmd.shard_id}-{kind}-{cmd.name}")
        if shard is not None:
            shard.adapter_task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def aclose(self) -> None:
        """Give up the commands under way (the engines are stopped by now) and close the HTTP client."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()

    async def _carry_out(self, cmd: AdapterCommand, previous: asyncio.Task | None) -> None:
        if previous is not None:
            await asyncio.wait({previous})  # its outcome is its own report's business
        # A stop or a sleep may have come while the commands before this one ran: asked again, then.
        problem = self.refusal(cmd)
        shard = self._shards.get(cmd.shard_id)
        if problem or shard is None or shard.launch.adapters is None:
            await self._status(cmd.shard_id, cmd.name, "failed", problem)
            return
        engine = EngineAdapters(self._client, f"http://{shard.launch.url_host}:{shard.port}", shard.launch.adapters)
        started = asyncio.get_running_loop().time()
        try:
            if isinstance(cmd, adapter_messages.LoadAdapter):
                log.info("shard %s: loading adapter %s from %s", cmd.shard_id, cmd.name, cmd.source)
                fresh = await engine.load(cmd.name, cmd.source)
            else:
                fresh = await engine.unload(cmd.name)
        except EngineAdapterError as exc:
            await self._status(cmd.shard_id, cmd.name, "failed", str(exc))
            return
        if isinstance(cmd, adapter_messages.LoadAdapter):
            shard.adapters.add(cmd.name)
            took = round(asyncio.get_running_loop().time() - started, 3)
            await self._status(cmd.shard_id, cmd.name, "loaded", "" if fresh else "the engine held it already", took)
        else:
            shard.adapters.discard(cmd.name)
            await self._status(cmd.shard_id, cmd.name, "unloaded", "" if fresh else "the engine did not hold it")

    async def _status(
        self, shard_id: int, name: str, state: AdapterState, message: str = "", seconds: float | None = None
    ) -> None:
        took = f" in {seconds:g} s" if seconds is not None else ""
        log.info("shard %s: adapter %s %s%s%s", shard_id, name, state, took, f" ({message})" if message else "")
        status = adapter_messages.AdapterStatus(
            shard_id=shard_id, name=name, state=state, message=message, seconds=seconds
        )
        if not await self._send(protocol.encode(status)):
            log.debug("not connected; dropped adapter_status for adapter %s of shard %s", name, shard_id)


def _not_ready(shard: Shard) -> str:
    """Why `shard`'s adapters cannot change now, or "" when it is ready."""
    if shard.stopping:
        return f"shard {shard.shard_id} is stopping"
    if shard.state == "ready":
        return ""
    return _NOT_READY.get(shard.state, "shard {shard} is {state}, not ready").format(
        shard=shard.shard_id, state=shard.state
    )


# Why a shard's adapters cannot change in a state other than ready.
_NOT_READY = {
    "starting": "shard {shard} is still starting; its adapters can change once it is ready",
    "draining": "shard {shard} is draining to stop",
    "falling_asleep": "shard {shard} is going to sleep",
    "sleeping": "shard {shard} is asleep; wake it first",
    "waking": "shard {shard} is waking; its adapters can change once it is ready",
}
