"""The agent protocol's LoRA adapter messages (re-exported by nodewire/protocol.py, where both ends import them).

control plane → agent, stamped and fenced like every command (an agent refuses a stale epoch) and acknowledged
with `ack` as soon as the agent has it:
  load_adapter    epoch, cid, shard_id, name, source: load the adapter from `source` (a folder on the node or
                  a hub id) into the shard's running engine under `name`; answered by adapter_status
                  `loaded` (with how long it took) or `failed` (the engine's words). Refused in the ack for a
                  shard that is not running and ready (starting, draining, asleep, waking), or an engine
                  started without adapter slots.
  unload_adapter  epoch, cid, shard_id, name: unload it; answered by adapter_status `unloaded` (also when the
                  engine did not hold it: the goal is reached) or `failed`.

agent → control plane:
  adapter_status  shard_id, name, state (loaded|unloaded|failed), message, seconds (a load's duration)

A heartbeat's `shards[].adapters` lists what each engine holds, so the control plane corrects what it
believes after an engine restart or a lost report.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from nodewire.parts import AdapterName, CommandId, _Message

LOAD_ADAPTER = "load_adapter"
UNLOAD_ADAPTER = "unload_adapter"
ADAPTER_STATUS = "adapter_status"

AdapterState = Literal["loaded", "unloaded", "failed"]


class LoadAdapter(_Message, frozen=True, kw_only=True, tag=LOAD_ADAPTER):
    """Load a LoRA adapter into a ready shard's engine under `name`, from `source`."""

    epoch: int
    cid: CommandId = ""
    shard_id: int
    name: AdapterName
    source: Annotated[str, Meta(min_length=1, max_length=500)]


class UnloadAdapter(_Message, frozen=True, kw_only=True, tag=UNLOAD_ADAPTER):
    """Unload the LoRA adapter `name` from a shard's engine."""

    epoch: int
    cid: CommandId = ""
    shard_id: int
    name: AdapterName


class AdapterStatus(_Message, frozen=True, kw_only=True, tag=ADAPTER_STATUS):
    """The outcome of load_adapter or unload_adapter on one shard; `seconds` is how long a load took."""

    shard_id: int
    name: AdapterName
    state: AdapterState
    message: str = ""
    seconds: Annotated[float, Meta(ge=0)] | None = None
