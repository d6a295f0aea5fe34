"""The agent protocol: JSON messages over the WebSocket at /agent/ws.

Both ends import this module, so a message is described in one place. Every
message carries `type` and `v` (PROTOCOL_VERSION). `parse_agent_message` is the
control plane's gate: anything malformed raises ProtocolError with a sentence
naming the problem, and nothing is written.

agent → control plane
  hello         node, version, address, fabric, labels{}, gpus[], shards[]
                gpus:   [{index, uuid, gpu_class, memory_mb, healthy}]
                shards: [{shard_id, replica_id, state, port}]   (what it runs now)
  heartbeat     gpus: [{index, healthy}], shards: [{shard_id, state}]
  shard_status  shard_id, state (starting|ready|failed|stopped), message, port

control plane → agent (each stamped with the leader's lease `epoch`; an agent
refuses a command older than the newest epoch it has seen — fencing)
  start_shard   epoch, shard_id, replica_id, rank, node_count, head_address,
                engine, model, source, gpu_indices[], port, args[], env{}
  stop_shard    epoch, shard_id
  drain_shard   epoch, shard_id
  error         message   (the control plane could not accept a message)
"""

from typing import Any

PROTOCOL_VERSION = 1

HELLO = "hello"
HEARTBEAT = "heartbeat"
SHARD_STATUS = "shard_status"
START_SHARD = "start_shard"
STOP_SHARD = "stop_shard"
DRAIN_SHARD = "drain_shard"
ERROR = "error"

SHARD_REPORT_STATES = ("starting", "ready", "failed", "stopped")

# Close codes the control plane uses (4000-4999 are application codes).
CLOSE_UNAUTHORIZED = 4001
CLOSE_SUPERSEDED = 4002
CLOSE_PROTOCOL = 4003


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text says what is wrong."""


def _require(msg: dict, key: str, kind, where: str):
    if key not in msg:
        raise ProtocolError(f"{where}: missing field “{key}”")
    value = msg[key]
    if kind is int and isinstance(value, bool):
        raise ProtocolError(f"{where}: field “{key}” must be an integer")
    if not isinstance(value, kind):
        name = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ProtocolError(f"{where}: field “{key}” must be {name}, got {type(value).__name__}")
    return value


def _gpus(msg: dict, where: str, full: bool) -> list[dict]:
    gpus = _require(msg, "gpus", list, where)
    seen = set()
    for i, gpu in enumerate(gpus):
        at = f"{where}.gpus[{i}]"
        if not isinstance(gpu, dict):
            raise ProtocolError(f"{at}: must be an object")
        index = _require(gpu, "index", int, at)
        if index < 0 or index in seen:
            raise ProtocolError(f"{at}: index {index} is negative or repeated")
        seen.add(index)
        _require(gpu, "healthy", bool, at)
        if full:
            _require(gpu, "uuid", str, at)
            if not _require(gpu, "gpu_class", str, at):
                raise ProtocolError(f"{at}: gpu_class is empty")
            if _require(gpu, "memory_mb", int, at) < 0:
                raise ProtocolError(f"{at}: memory_mb is negative")
    return gpus


def _shards(msg: dict, where: str) -> list[dict]:
    shards = msg.get("shards", [])
    if not isinstance(shards, list):
        raise ProtocolError(f"{where}: field “shards” must be a list")
    for i, shard in enumerate(shards):
        at = f"{where}.shards[{i}]"
        if not isinstance(shard, dict):
            raise ProtocolError(f"{at}: must be an object")
        _require(shard, "shard_id", int, at)
        _require(shard, "state", str, at)
    return shards


def parse_agent_message(msg: Any) -> dict:
    """Validate a message from an agent and return it; raise ProtocolError if malformed."""
    if not isinstance(msg, dict):
        raise ProtocolError("a message must be a JSON object")
    kind = msg.get("type")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {msg.get('v')!r} is not supported (this control plane speaks {PROTOCOL_VERSION})")
    if kind == HELLO:
        _require(msg, "node", str, kind)
        _require(msg, "version", str, kind)
        _require(msg, "address", str, kind)
        fabric = msg.setdefault("fabric", "")
        if not isinstance(fabric, str):
            raise ProtocolError("hello: field “fabric” must be str")
        labels = msg.setdefault("labels", {})
        if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise ProtocolError("hello: field “labels” must be an object of strings")
        _gpus(msg, kind, full=True)
        _shards(msg, kind)
    elif kind == HEARTBEAT:
        _gpus(msg, kind, full=False)
        _shards(msg, kind)
    elif kind == SHARD_STATUS:
        _require(msg, "shard_id", int, kind)
        state = _require(msg, "state", str, kind)
        if state not in SHARD_REPORT_STATES:
            raise ProtocolError(f"shard_status: state “{state}” is not one of {', '.join(SHARD_REPORT_STATES)}")
        msg.setdefault("message", "")
        if not isinstance(msg["message"], str):
            raise ProtocolError("shard_status: field “message” must be str")
        port = msg.setdefault("port", None)
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise ProtocolError("shard_status: field “port” must be a TCP port")
    else:
        raise ProtocolError(f"unknown message type {kind!r}")
    return msg


def command(kind: str, epoch: int, **fields) -> dict:
    """Build a control-plane → agent command."""
    return {"type": kind, "v": PROTOCOL_VERSION, "epoch": epoch, **fields}


def parse_port(value) -> int:
    """A TCP port from text or a number, or ValueError naming what is wrong."""
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"port {value!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is outside 1-65535")
    return port
