"""The parts of agent messages (nodewire/protocol.py): list items, untagged and unversioned, and the checks on them.

The weights items are in nodewire/weights/messages.py.

Defined apart from the messages so nodewire/protocol.py holds the messages and their gates; both are
re-exported there, the one place other modules import them from.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import UNSET, Meta, Struct, UnsetType

PROTOCOL_VERSION = 1
PORT = Annotated[int, Meta(ge=1, le=65535)]
GPUIndex = Annotated[int, Meta(ge=0)]
# A command id: unique per command, answered by `ack`; empty on a command that wants no answer.
CommandId = Annotated[str, Meta(max_length=64)]
# An adapter's public name, as the catalog allows it and engines load it under.
AdapterName = Annotated[str, Meta(min_length=1, max_length=200)]


class _Message(Struct, frozen=True, kw_only=True, tag_field="type"):
    """What every message has: its `type` tag (set by each subclass) and the protocol version."""

    v: int = PROTOCOL_VERSION


def _no_repeated_gpus(indices: list[int], where: str) -> None:
    seen: set[int] = set()
    for index in indices:
        if index in seen:
            # __post_init__ errors carry no path at the top level, so the sentence names the field.
            raise ValueError(f"GPU index {index} is repeated in `{where}`")
        seen.add(index)


class GPUReport(Struct, frozen=True, kw_only=True):
    """One GPU as `hello` describes it."""

    index: GPUIndex
    uuid: str
    gpu_class: Annotated[str, Meta(min_length=1)]
    memory_mb: Annotated[int, Meta(ge=0)]
    healthy: bool
    reason: str = ""


class GPUHealth(Struct, frozen=True, kw_only=True):
    """One GPU's health as `heartbeat` reports it; `reason` says why when unhealthy (XID, ECC, lost, …)."""

    index: GPUIndex
    healthy: bool
    reason: str = ""


class AdapterSlots(Struct, frozen=True, kw_only=True):
    """LoRA on a shard's engine: how many adapters it holds at once, and the largest rank it loads (None = the
    engine's default). A start_shard carries it for a profile that takes adapters; agent/engines/launch.py says the flags."""

    slots: Annotated[int, Meta(ge=1)]
    max_rank: Annotated[int, Meta(ge=1)] | None = None


class RunningShard(Struct, frozen=True, kw_only=True):
    """A shard the agent runs now, as `hello` reports it (the control plane adopts or stops it)."""

    shard_id: int
    replica_id: int | None
    state: str
    port: PORT | None


class ShardHeartbeat(Struct, frozen=True, kw_only=True):
    """A running shard's state as `heartbeat` reports it.

    `running` is the number of requests the engine holds (running or queued)
    by its own /metrics, or None when that is not known (DESIGN invariant 3:
    unknown is not idle).
    """

    shard_id: int
    state: str
    running: Annotated[int, Meta(ge=0)] | None = None
    # The LoRA adapters the engine holds now, by name; absent when it takes none (started without adapter slots).
    adapters: list[AdapterName] | UnsetType = UNSET
