"""The agent protocol: typed JSON messages over the WebSocket at /agent/ws.

Each message is a frozen msgspec Struct defined once here; both ends build
with these types and check what they receive with the two gates below, so the
receiving side trusts what the gate let through. Every message carries
`type` (its tag) and `v`.

agent → control plane (`AgentMessage`, checked by `decode_agent_message`)
  hello         node, version, address, fabric, labels{}, gpus[], shards[], weights[],
                host_memory_mib (null = unknown), weights_port (where peers copy its weights from;
                absent = it serves none)
  heartbeat     gpus[{index, healthy, reason}], shards[{shard_id, state, running}], weights[]
                (running: requests the engine holds, running or queued; null = unknown)
                (state: a shard_status state or one of the agent's in-between ones: draining,
                falling_asleep, sleeping, waking; hello's shards[] the same)
                (weights: every source on disk, {source, path, size_bytes, header}; null =
                unchanged since last reported, or no weights root; header: what the weights'
                headers say of their size and shape, nodewire/weights/messages.py, null = not read)
  shard_status  shard_id, state (starting|ready|sleeping|failed|stopped), message, port, port_busy,
                seconds (how long the sleep or wake it reports took; null otherwise),
                sleep_level (with `sleeping`: 1 or 2)
  weights_status source, path, removed, message   (the answer to remove_weights)
  (heartbeat's shards[] also carry adapters[]: the LoRA adapters each engine holds)
  ack           cid, refused, message: the command `cid` reached the agent and was
                accepted (refused = fenced, malformed, or a sleep or wake that cannot be
                done; message says why)

control plane → agent (`Command`, checked by `decode_command`); each command is
stamped with the leader's lease `epoch`, and an agent refuses one older than
the newest epoch it has seen (fencing, DESIGN invariant 1). A command with a
`cid` (command id) is answered with `ack` as soon as the agent has it, refused or
not; the control plane re-sends it until then (reconciler/commands.py)
  start_shard   epoch, shard_id, replica_id, rank, node_count, head_address,
                engine, model, source, gpu_indices[], port, args[], env{},
                (env: extra environment for the engine, checked by nodewire/engine_env.py)
                host (where the engine listens; "" = the agent's --address), rendezvous_port
                (where a multi-node replica's ranks meet, on the head node; 0 for one node),
                sleep_mode (start able to sleep), adapters {slots, max_rank} (start with LoRA
                on); both absent unless set, agent/engines/launch.py says how
  stop_shard    epoch, shard_id
  drain_shard   epoch, shard_id, timeout_seconds (default 300): stop once the engine
                reports no requests in flight, or when the timeout passes
  sleep_shard   epoch, shard_id, level (1|2), timeout_seconds (default 300): once the engine
                reports no requests in flight (or the timeout passes), put it to sleep;
                answered with shard_status `sleeping`, or `failed` (the engine is stopped)
  wake_shard    epoch, shard_id: wake a sleeping engine; answered with shard_status `ready`
                (with its port), or `failed`. Sleep and wake are refused in the ack (refused,
                message says why) for a shard not running, an engine that cannot sleep, or a
                shard in the wrong state (agent/hibernation.py)
  remove_weights epoch, source, path: delete a source's weights from the node's disk
  load_adapter, unload_adapter, and the agent's adapter_status: nodewire/adapter_messages.py
  stage_weights, serve_weights, and the agent's staging_status: nodewire/weights/staging_messages.py
  error         message   (the control plane could not accept a message)
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from nodewire.adapter_messages import (
    ADAPTER_STATUS,
    LOAD_ADAPTER,
    UNLOAD_ADAPTER,
    AdapterStatus,
    LoadAdapter,
    UnloadAdapter,
)
from nodewire.engine_env import env_problem
from nodewire.parts import (
    PORT,
    PROTOCOL_VERSION,
    AdapterSlots,
    CommandId,
    GPUHealth,
    GPUIndex,
    GPUReport,
    RunningShard,
    ShardHeartbeat,
    _Message,
    _no_repeated_gpus,
)
from nodewire.weights.messages import WeightsReport, no_repeated_sources
from nodewire.weights.staging_messages import (
    SERVE_WEIGHTS,
    STAGE_WEIGHTS,
    STAGING_STATUS,
    ServeWeights,
    StageWeights,
    StagingStatus,
)

HELLO = "hello"
HEARTBEAT = "heartbeat"
SHARD_STATUS = "shard_status"
ACK = "ack"
START_SHARD = "start_shard"
STOP_SHARD = "stop_shard"
DRAIN_SHARD = "drain_shard"
REMOVE_WEIGHTS = "remove_weights"
SLEEP_SHARD = "sleep_shard"
WAKE_SHARD = "wake_shard"
WEIGHTS_STATUS = "weights_status"
ERROR = "error"

ShardState = Literal["starting", "ready", "sleeping", "failed", "stopped"]
SHARD_REPORT_STATES: tuple[str, ...] = get_args(ShardState)

# vLLM's sleep levels: 1 moves the weights to host memory, 2 discards them (reloaded from disk on wake).
SleepLevel = Literal[1, 2]

# Close codes the control plane uses (4000-4999 are application codes).
CLOSE_UNAUTHORIZED = 4001
CLOSE_SUPERSEDED = 4002
CLOSE_PROTOCOL = 4003

# Node names become channel-layer group names, hence the short, plain alphabet.
NODE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"

NodeName = Annotated[str, Meta(pattern=NODE_NAME_PATTERN)]


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text says what is wrong.

    `kind`, `epoch` and `shard_id` hold what could still be read from the
    message (None otherwise), so an agent can answer a malformed start for a
    shard it can name instead of leaving the control plane waiting.
    """

    def __init__(
        self,
        text: str,
        kind: str | None = None,
        epoch: int | None = None,
        shard_id: int | None = None,
        cid: str | None = None,
    ):
        super().__init__(text)
        self.kind = kind
        self.epoch = epoch
        self.shard_id = shard_id
        self.cid = cid


def parse_port(text: str | int) -> int:
    """A TCP port from text or an int; ValueError says why not (the one port rule of the project)."""
    try:
        # type() rather than isinstance(): True is not port 1.
        port = text if type(text) is int else int(str(text))
    except ValueError:
        raise ValueError(f"port {text!r} is not a number") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is outside 1-65535")
    return port


class Hello(_Message, frozen=True, kw_only=True, tag=HELLO):
    """The agent's first message on a stream: who it is, its GPUs and the shards it runs."""

    node: NodeName
    version: str
    address: str
    fabric: str = ""
    labels: dict[str, str] = {}
    gpus: list[GPUReport]
    shards: list[RunningShard] = []
    # None: the agent has no weights root (or predates weights), so nothing is known.
    weights: list[WeightsReport] | None = None
    # The node's host memory in MiB (level-1 sleepers keep their weights there); left out when not known.
    host_memory_mib: Annotated[int, Meta(ge=0)] | UnsetType = UNSET
    # Where its weights server listens, for peers to copy from (agent/weights/peer_server.py); left out: none.
    weights_port: PORT | UnsetType = UNSET

    def __post_init__(self) -> None:
        _no_repeated_gpus([gpu.index for gpu in self.gpus], "gpus")
        no_repeated_sources(self.weights)


class Heartbeat(_Message, frozen=True, kw_only=True, tag=HEARTBEAT):
    """The agent's periodic report: GPU health and the state of each shard."""

    gpus: list[GPUHealth]
    shards: list[ShardHeartbeat] = []
    # Only after a scan found a change; None (most heartbeats) leaves what is known alone.
    weights: list[WeightsReport] | None = None

    def __post_init__(self) -> None:
        _no_repeated_gpus([gpu.index for gpu in self.gpus], "gpus")
        no_repeated_sources(self.weights)


class ShardStatus(_Message, frozen=True, kw_only=True, tag=SHARD_STATUS):
    """A change of one shard's state; `port` is set once it is ready.

    `port_busy` on a failed start says the assigned `port` was taken on the node
    by something else: the node's problem, not the replica's, and a port the
    control plane must not give that node again for a while.
    """

    shard_id: int
    state: ShardState
    message: str = ""
    port: PORT | None = None
    port_busy: bool = False
    # A sleep (`sleeping`) or a wake (`ready` after one) reports how long it took, so wake times can be learned.
    seconds: Annotated[float, Meta(ge=0)] | None = None
    sleep_level: SleepLevel | None = None


class Ack(_Message, frozen=True, kw_only=True, tag=ACK):
    """The agent has command `cid`: accepted, or refused (stale epoch, malformed) with the reason.

    Sent before the command is carried out, so a slow start does not look like a lost one.
    """

    cid: Annotated[str, Meta(min_length=1, max_length=64)]
    refused: bool = False
    message: str = ""


class StartShard(_Message, frozen=True, kw_only=True, tag=START_SHARD):
    """Start one shard (one node's part of a replica) on the given GPUs and port."""

    epoch: int
    cid: CommandId = ""
    shard_id: int
    replica_id: int | None = None
    rank: Annotated[int, Meta(ge=0)] = 0
    node_count: Annotated[int, Meta(ge=1)] = 1
    head_address: str = ""
    engine: str
    model: str
    source: str
    gpu_indices: list[GPUIndex]
    port: PORT
    args: list[str] = []
    env: dict[str, str] = {}
    # The node's management address, where its endpoint is published; "" = the agent's own --address.
    host: str = ""
    # A port on the head node, reserved beside the head's engine port, where a multi-node replica's ranks meet.
    rendezvous_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    # Absent unless set, so a start without them keeps the shape starts always had (agent/engines/launch.py: the flags).
    sleep_mode: bool | UnsetType = UNSET
    adapters: AdapterSlots | UnsetType = UNSET

    @property
    def able_to_sleep(self) -> bool:
        """Whether the engine is to be started able to sleep (`sleep_mode` true; absent is no)."""
        return self.sleep_mode is True

    def __post_init__(self) -> None:
        _no_repeated_gpus(self.gpu_indices, "gpu_indices")


class StopShard(_Message, frozen=True, kw_only=True, tag=STOP_SHARD):
    """Stop a shard's engine now (SIGTERM, then SIGKILL after a grace)."""

    epoch: int
    cid: CommandId = ""
    shard_id: int


DEFAULT_DRAIN_TIMEOUT_SECONDS = 300.0


class DrainShard(_Message, frozen=True, kw_only=True, tag=DRAIN_SHARD):
    """Stop a shard's engine once it reports no requests in flight, or after `timeout_seconds` regardless."""

    epoch: int
    cid: CommandId = ""
    shard_id: int
    timeout_seconds: Annotated[float, Meta(ge=0)] = DEFAULT_DRAIN_TIMEOUT_SECONDS


class SleepShard(_Message, frozen=True, kw_only=True, tag=SLEEP_SHARD):
    """Put a shard's engine to sleep at `level` once it holds no requests, or after `timeout_seconds` regardless.

    The control plane has already unpublished the replica, so no new requests arrive (a sleep is a drain).
    """

    epoch: int
    cid: CommandId = ""
    shard_id: int
    level: SleepLevel = 1
    timeout_seconds: Annotated[float, Meta(ge=0)] = DEFAULT_DRAIN_TIMEOUT_SECONDS


class WakeShard(_Message, frozen=True, kw_only=True, tag=WAKE_SHARD):
    """Wake a sleeping shard's engine; it is reported `ready` once it serves again."""

    epoch: int
    cid: CommandId = ""
    shard_id: int


class RemoveWeights(_Message, frozen=True, kw_only=True, tag=REMOVE_WEIGHTS):
    """Delete a source's weights at `path` (as the node reported it); the agent answers with weights_status."""

    epoch: int
    cid: CommandId = ""
    source: Annotated[str, Meta(min_length=1)]
    path: Annotated[str, Meta(min_length=1)]


class WeightsStatus(_Message, frozen=True, kw_only=True, tag=WEIGHTS_STATUS):
    """The outcome of remove_weights: removed, or refused (the message says why)."""

    source: str
    path: str
    removed: bool
    message: str = ""


class Error(_Message, frozen=True, kw_only=True, tag=ERROR):
    """The control plane could not accept a message; the text says why."""

    message: str


AgentMessage = Hello | Heartbeat | ShardStatus | WeightsStatus | AdapterStatus | StagingStatus | Ack
Command = (
    StartShard
    | StopShard
    | DrainShard
    | SleepShard
    | WakeShard
    | RemoveWeights
    | StageWeights
    | ServeWeights
    | LoadAdapter
    | UnloadAdapter
)

_AGENT_MESSAGES: dict[str, type[Any]] = {
    HELLO: Hello,
    HEARTBEAT: Heartbeat,
    SHARD_STATUS: ShardStatus,
    WEIGHTS_STATUS: WeightsStatus,
    ADAPTER_STATUS: AdapterStatus,
    STAGING_STATUS: StagingStatus,
    ACK: Ack,
}
_COMMANDS: dict[str, type[Any]] = {
    START_SHARD: StartShard,
    STOP_SHARD: StopShard,
    DRAIN_SHARD: DrainShard,
    SLEEP_SHARD: SleepShard,
    WAKE_SHARD: WakeShard,
    REMOVE_WEIGHTS: RemoveWeights,
    STAGE_WEIGHTS: StageWeights,
    SERVE_WEIGHTS: ServeWeights,
    LOAD_ADAPTER: LoadAdapter,
    UNLOAD_ADAPTER: UnloadAdapter,
}
_FROM_CONTROL_PLANE: dict[str, type[Any]] = {**_COMMANDS, ERROR: Error}

_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
_json_decoder = msgspec.json.Decoder()
_json_encoder = msgspec.json.Encoder()


def decode_agent_message(raw: str | bytes) -> AgentMessage:
    """The control plane's gate: a frame from an agent as a typed message; ProtocolError if malformed."""
    return _check(_json(raw), _AGENT_MESSAGES)


def decode_command(raw: str | bytes) -> Command | Error:
    """The agent's gate: a frame from the control plane as a typed command (or error); ProtocolError if malformed."""
    return _check(_json(raw), _FROM_CONTROL_PLANE)


def encode(message: AgentMessage | Command | Error) -> bytes:
    """A message as JSON bytes, the form it takes on the WebSocket."""
    return _json_encoder.encode(message)


def to_builtins(message: Struct) -> dict[str, Any]:
    """A message (or part of one) as plain dicts and lists, e.g. for channel-layer payloads."""
    return msgspec.to_builtins(message)


def _json(raw: str | bytes) -> Any:
    try:
        return _json_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"message is not JSON: {exc}") from None


def _int_or_none(value: Any) -> int | None:
    return value if type(value) is int else None


def _check(obj: Any, types: dict[str, type[Any]]) -> Any:
    """Validate a decoded JSON value against the message type its `type` names."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message must be a JSON object, not {_JSON_KINDS.get(type(obj), 'null')}")
    kind, version = obj.get("type"), obj.get("v")
    found: dict[str, Any] = {
        "kind": kind if isinstance(kind, str) else None,
        "epoch": _int_or_none(obj.get("epoch")),
        "shard_id": _int_or_none(obj.get("shard_id")),
        "cid": cid if isinstance(cid := obj.get("cid"), str) and cid else None,
    }
    # The version is checked first: another version may name its types and fields differently.
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not supported; this end speaks version {PROTOCOL_VERSION}", **found
        )
    if kind not in types:
        raise ProtocolError(f"unknown message type {kind!r}; expected one of {', '.join(types)}", **found)
    if kind == START_SHARD and isinstance(obj.get("args"), str):
        # Engine args look like a command line, so this is the likely mistake; name it, not a type mismatch.
        raise ProtocolError(
            "start_shard: engine args must be a list of strings (an argv), not a shell string - at `$.args`", **found
        )
    if kind == START_SHARD and "env" in obj and (problem := env_problem(obj["env"])) is not None:
        # Checked before the types, so a bad value is named by its variable; the message holds no value.
        raise ProtocolError(f"start_shard: {problem} - at `$.env`", **found)
    try:
        return msgspec.convert(obj, types[kind], strict=True)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"{kind}: {exc}", **found) from None
