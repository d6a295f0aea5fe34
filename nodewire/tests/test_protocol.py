"""The agent protocol: every message survives build → encode → decode, and each malformation is refused by name."""

import json
import re

import msgspec
import pytest

from nodewire import parts, protocol
from nodewire.parts import GPUHealth, GPUReport, RunningShard, ShardHeartbeat
from nodewire.protocol import DrainShard, Error, Heartbeat, Hello, ProtocolError, ShardStatus, StartShard, StopShard

HELLO = Hello(
    node="gpu-07",
    version="0.1.0",
    address="10.0.0.7",
    fabric="ib-a",
    labels={"rack": "r3"},
    gpus=[
        GPUReport(index=0, uuid="GPU-a", gpu_class="H100-80GB", memory_mb=81920, healthy=True),
        GPUReport(index=1, uuid="GPU-b", gpu_class="H100-80GB", memory_mb=81920, healthy=False),
    ],
    shards=[RunningShard(shard_id=4, replica_id=9, state="ready", port=20001)],
)
HEARTBEAT = Heartbeat(
    gpus=[GPUHealth(index=0, healthy=True), GPUHealth(index=1, healthy=False)],
    shards=[ShardHeartbeat(shard_id=4, state="ready"), ShardHeartbeat(shard_id=5, state="draining", running=3)],
)
SHARD_STATUS = ShardStatus(shard_id=4, state="failed", message="engine exited with code 2", port=None)
START = StartShard(
    epoch=3,
    shard_id=4,
    replica_id=9,
    rank=1,
    node_count=2,
    head_address="10.0.0.6",
    engine="vllm",
    model="llama-70b",
    source="meta-llama/Llama-3.1-70B-Instruct",
    gpu_indices=[0, 1],
    port=20001,
    args=["--max-model-len", "8192"],
    env={"NCCL_DEBUG": "INFO"},
)


def hello_dict(**changes) -> dict:
    message = protocol.to_builtins(HELLO)
    message.update(changes)
    return message


def start_dict(**changes) -> dict:
    message = protocol.to_builtins(START)
    message.update(changes)
    return message


def refused(gate, message, problem: str) -> ProtocolError:
    raw = message if isinstance(message, str | bytes) else json.dumps(message)
    with pytest.raises(ProtocolError, match=problem) as caught:
        gate(raw)
    return caught.value


@pytest.mark.parametrize(
    "message", [HELLO, HEARTBEAT, SHARD_STATUS, Hello(node="n", version="v", address="a", gpus=[])]
)
def test_agent_messages_round_trip(message):
    assert protocol.decode_agent_message(protocol.encode(message)) == message
    assert protocol.decode_agent_message(protocol.encode(message).decode()) == message


@pytest.mark.parametrize(
    "message",
    [
        START,
        StopShard(epoch=3, shard_id=4),
        DrainShard(epoch=3, shard_id=4),
        DrainShard(epoch=3, shard_id=4, timeout_seconds=0.0),
        Error(message="no"),
    ],
)
def test_commands_round_trip(message):
    assert protocol.decode_command(protocol.encode(message)) == message


def test_the_wire_shape_is_the_dict_shape_the_protocol_always_had():
    # Fields added since (GPU `reason`, `weights`, a status's `seconds` and `sleep_level`) are optional: see the
    # backward-compatibility test.
    assert json.loads(protocol.encode(HELLO)) == {
        "type": "hello",
        "v": 1,
        "node": "gpu-07",
        "version": "0.1.0",
        "address": "10.0.0.7",
        "fabric": "ib-a",
        "labels": {"rack": "r3"},
        "gpus": [
            {"index": 0, "uuid": "GPU-a", "gpu_class": "H100-80GB", "memory_mb": 81920, "healthy": True, "reason": ""},
            {"index": 1, "uuid": "GPU-b", "gpu_class": "H100-80GB", "memory_mb": 81920, "healthy": False, "reason": ""},
        ],
        "shards": [{"shard_id": 4, "replica_id": 9, "state": "ready", "port": 20001}],
        "weights": None,
    }
    assert protocol.to_builtins(HEARTBEAT) == {
        "type": "heartbeat",
        "v": 1,
        "gpus": [{"index": 0, "healthy": True, "reason": ""}, {"index": 1, "healthy": False, "reason": ""}],
        "shards": [
            {"shard_id": 4, "state": "ready", "running": None},
            {"shard_id": 5, "state": "draining", "running": 3},
        ],
        "weights": None,
    }
    assert protocol.to_builtins(SHARD_STATUS) == {
        "type": "shard_status",
        "v": 1,
        "shard_id": 4,
        "state": "failed",
        "message": "engine exited with code 2",
        "port": None,
        "port_busy": False,
        "seconds": None,
        "sleep_level": None,
    }
    # An agent that predates `port_busy` still speaks the protocol: the field defaults to False.
    older = protocol.decode_agent_message('{"type": "shard_status", "v": 1, "shard_id": 4, "state": "failed"}')
    assert older.port_busy is False
    assert set(protocol.to_builtins(START)) == {
        "type", "v", "epoch", "cid", "shard_id", "replica_id", "rank", "node_count", "head_address",
        "engine", "model", "source", "gpu_indices", "port", "args", "env", "host", "rendezvous_port",
    }  # fmt: skip
    # A control plane that predates `rendezvous_port` still speaks the protocol: one node, no rendezvous.
    without = {k: v for k, v in protocol.to_builtins(START).items() if k != "rendezvous_port"}
    assert protocol.decode_command(json.dumps(without)).rendezvous_port == 0
    assert protocol.to_builtins(StopShard(epoch=2, shard_id=5, cid="c1")) == {
        "type": "stop_shard",
        "v": 1,
        "epoch": 2,
        "cid": "c1",
        "shard_id": 5,
    }
    assert protocol.to_builtins(DrainShard(epoch=2, shard_id=5, timeout_seconds=30)) == {
        "type": "drain_shard",
        "v": 1,
        "epoch": 2,
        "cid": "",
        "shard_id": 5,
        "timeout_seconds": 30,
    }
    assert protocol.to_builtins(Error(message="x")) == {"type": "error", "v": 1, "message": "x"}
    assert protocol.to_builtins(protocol.Ack(cid="c1")) == {
        "type": "ack",
        "v": 1,
        "cid": "c1",
        "refused": False,
        "message": "",
    }


def test_heartbeat_running_and_drain_timeout_are_optional_so_version_1_peers_still_agree():
    older_beat = protocol.decode_agent_message(
        '{"type": "heartbeat", "v": 1, "gpus": [], "shards": [{"shard_id": 4, "state": "ready"}]}'
    )
    assert older_beat.shards == [ShardHeartbeat(shard_id=4, state="ready", running=None)]
    older_drain = protocol.decode_command('{"type": "drain_shard", "v": 1, "epoch": 2, "shard_id": 5}')
    assert older_drain == DrainShard(epoch=2, shard_id=5, timeout_seconds=protocol.DEFAULT_DRAIN_TIMEOUT_SECONDS)
    assert older_drain.timeout_seconds == 300.0
    # A command from a control plane that predates acknowledgements has no id: the agent answers nothing.
    assert older_drain.cid == ""


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        ([{"shard_id": 4, "state": "ready", "running": -1}], r"Expected `int` >= 0 - at `\$.shards\[0\].running`"),
        ([{"shard_id": 4, "state": "ready", "running": 1.5}], r"Expected `int \| null`, got `float`"),
        ([{"shard_id": 4, "state": "ready", "running": "3"}], r"Expected `int \| null`, got `str`"),
    ],
)
def test_heartbeat_running_must_be_a_count_or_null(message, problem):
    refused(protocol.decode_agent_message, {"type": "heartbeat", "v": 1, "gpus": [], "shards": message}, problem)


@pytest.mark.parametrize(
    ("timeout", "problem"),
    [
        (-1, r"drain_shard: Expected `float` >= 0.0 - at `\$.timeout_seconds`"),
        ("300", r"drain_shard: Expected `float`, got `str` - at `\$.timeout_seconds`"),
        (None, r"drain_shard: Expected `float`, got `null` - at `\$.timeout_seconds`"),
    ],
)
def test_drain_timeout_must_be_a_non_negative_number_of_seconds(timeout, problem):
    message = {"type": "drain_shard", "v": 1, "epoch": 2, "shard_id": 5, "timeout_seconds": timeout}
    error = refused(protocol.decode_command, message, problem)
    # What could be read still names the shard, as for every other malformed command.
    assert (error.kind, error.epoch, error.shard_id) == ("drain_shard", 2, 5)


def test_optional_fields_take_their_defaults_when_absent():
    hello = protocol.decode_agent_message(
        '{"type": "hello", "v": 1, "node": "n", "version": "v", "address": "a", "gpus": []}'
    )
    assert (hello.fabric, hello.labels, hello.shards) == ("", {}, [])
    status = protocol.decode_agent_message('{"type": "shard_status", "v": 1, "shard_id": 1, "state": "starting"}')
    assert (status.message, status.port) == ("", None)
    start = protocol.decode_command(
        json.dumps({"type": "start_shard", "v": 1, "epoch": 1, "shard_id": 1, "engine": "mock", "model": "m",
                    "source": "m", "gpu_indices": [], "port": 20000})
    )  # fmt: skip
    assert (start.replica_id, start.rank, start.node_count, start.head_address, start.args, start.env) == (
        None, 0, 1, "", [], {}
    )  # fmt: skip


def test_fields_a_newer_agent_adds_are_ignored():
    assert protocol.decode_agent_message(json.dumps(hello_dict(cpu_model=["EPYC 9654"]))) == HELLO


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("{not json", "message is not JSON"),
        (b"\xff\xfe", "message is not JSON"),
        ("[1, 2]", "a message must be a JSON object, not an array"),
        ('"hello"', "a message must be a JSON object, not a string"),
        ("null", "a message must be a JSON object, not null"),
        ('{"type": "bogus", "v": 1}', "unknown message type 'bogus'"),
        ('{"v": 1}', "unknown message type None"),
        ('{"type": "hello", "v": 2}', "protocol version 2 is not supported; this end speaks version 1"),
        ('{"type": "hello"}', "protocol version None is not supported; this end speaks version 1"),
        ('{"type": "hello", "v": true}', "protocol version True is not supported"),
    ],
)
def test_frames_that_are_not_messages_of_this_version_are_refused_by_both_gates(raw, problem):
    refused(protocol.decode_agent_message, raw, problem)
    refused(protocol.decode_command, raw, problem)


def test_each_gate_accepts_only_its_own_direction():
    refused(protocol.decode_agent_message, protocol.encode(START), "unknown message type 'start_shard'")
    refused(protocol.decode_command, protocol.encode(HELLO), "unknown message type 'hello'")


def gpu(**changes) -> dict:
    return {"index": 0, "uuid": "GPU-a", "gpu_class": "H100-80GB", "memory_mb": 81920, "healthy": True, **changes}


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        ({k: v for k, v in hello_dict().items() if k != "node"}, "hello: Object missing required field `node`"),
        (hello_dict(address=7), re.escape("hello: Expected `str`, got `int` - at `$.address`")),
        (hello_dict(node="bad name!"), re.escape("at `$.node`")),
        (hello_dict(gpus=[gpu(index=True)]), re.escape("Expected `int`, got `bool` - at `$.gpus[0].index`")),
        (hello_dict(gpus=[gpu(index=-1)]), re.escape("Expected `int` >= 0 - at `$.gpus[0].index`")),
        (hello_dict(gpus=[gpu(), gpu()]), "GPU index 0 is repeated in `gpus`"),
        (hello_dict(gpus=[gpu(gpu_class="")]), re.escape("Expected `str` of length >= 1 - at `$.gpus[0].gpu_class`")),
        (hello_dict(gpus=[gpu(memory_mb=-1)]), re.escape("Expected `int` >= 0 - at `$.gpus[0].memory_mb`")),
        (hello_dict(gpus=[gpu(memory_mb=1.5)]), re.escape("Expected `int`, got `float` - at `$.gpus[0].memory_mb`")),
        (hello_dict(gpus=[gpu(healthy=1)]), re.escape("Expected `bool`, got `int` - at `$.gpus[0].healthy`")),
        (hello_dict(labels={"rack": 3}), re.escape("Expected `str`, got `int` - at `$.labels[...]`")),
        (hello_dict(labels=["rack"]), re.escape("Expected `object`, got `array` - at `$.labels`")),
        (hello_dict(shards=[{"shard_id": "4", "replica_id": None, "state": "ready", "port": None}]),
         re.escape("Expected `int`, got `str` - at `$.shards[0].shard_id`")),
        (hello_dict(shards=[{"shard_id": 4, "replica_id": None, "state": "ready", "port": 70000}]),
         re.escape("Expected `int` <= 65535 - at `$.shards[0].port`")),
        ({"type": "heartbeat", "v": 1}, "heartbeat: Object missing required field `gpus`"),
        ({"type": "heartbeat", "v": 1, "gpus": [{"index": 1, "healthy": True}] * 2}, "GPU index 1 is repeated"),
        ({"type": "heartbeat", "v": 1, "gpus": [], "shards": [{"shard_id": 1.0, "state": "ready"}]},
         re.escape("Expected `int`, got `float` - at `$.shards[0].shard_id`")),
        ({"type": "shard_status", "v": 1, "shard_id": True, "state": "ready"}, re.escape("got `bool` - at `$.shard_id`")),
        ({"type": "shard_status", "v": 1, "shard_id": 1, "state": "lost"}, re.escape("Invalid enum value 'lost' - at `$.state`")),
        ({"type": "shard_status", "v": 1, "shard_id": 1, "state": "ready", "port": 0}, re.escape("Expected `int` >= 1 - at `$.port`")),
        ({"type": "shard_status", "v": 1, "shard_id": 1, "state": "ready", "port": 65536}, re.escape("<= 65535 - at `$.port`")),
        ({"type": "shard_status", "v": 1, "shard_id": 1, "state": "ready", "message": None}, re.escape("at `$.message`")),
    ],
)  # fmt: skip
def test_malformed_agent_messages_are_refused_naming_the_problem(message, problem):
    refused(protocol.decode_agent_message, message, problem)


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        (start_dict(epoch=None), re.escape("start_shard: Expected `int`, got `null` - at `$.epoch`")),
        (start_dict(shard_id="4"), re.escape("Expected `int`, got `str` - at `$.shard_id`")),
        (start_dict(port=True), re.escape("Expected `int`, got `bool` - at `$.port`")),
        (start_dict(port=70000), re.escape("Expected `int` <= 65535 - at `$.port`")),
        (start_dict(gpu_indices=[0, -1]), re.escape("Expected `int` >= 0 - at `$.gpu_indices[1]`")),
        (start_dict(gpu_indices=[1, 1]), "GPU index 1 is repeated in `gpu_indices`"),
        (start_dict(gpu_indices="0,1"), re.escape("at `$.gpu_indices`")),
        (start_dict(args="--max-model-len 8192"), "engine args must be a list of strings \\(an argv\\), not a shell string"),
        (start_dict(args=["--tp", 2]), re.escape("Expected `str`, got `int` - at `$.args[1]`")),
        (start_dict(env={"A": 1}), re.escape("start_shard: Variable A: the value must be a string, not a number")),
        (start_dict(env={"HF_TOKEN": 12345}), "Variable HF_TOKEN: the value must be a string(?!.*12345)"),
        (start_dict(env={"1A": "x"}), re.escape("Variable name '1A' is not valid") + ".* - at `\\$.env`"),
        (start_dict(env={"A": "x\x00"}), "Variable A: the value holds a NUL character"),
        (start_dict(env=["A=1"]), "Engine env must be a mapping of variable names to strings"),
        (start_dict(env={"CUDA_VISIBLE_DEVICES": "3"}), "Variable CUDA_VISIBLE_DEVICES cannot be set on a profile"),
        (start_dict(rank=-1), re.escape("Expected `int` >= 0 - at `$.rank`")),
        (start_dict(node_count=0), re.escape("Expected `int` >= 1 - at `$.node_count`")),
        ({k: v for k, v in start_dict().items() if k != "engine"}, "start_shard: Object missing required field `engine`"),
        ({"type": "stop_shard", "v": 1, "shard_id": 4}, "stop_shard: Object missing required field `epoch`"),
        ({"type": "drain_shard", "v": 1, "epoch": 1, "shard_id": False}, re.escape("got `bool` - at `$.shard_id`")),
        ({"type": "error", "v": 1}, "error: Object missing required field `message`"),
    ],
)  # fmt: skip
def test_malformed_commands_are_refused_naming_the_problem(message, problem):
    refused(protocol.decode_command, message, problem)


def test_a_refusal_carries_what_could_still_be_read_so_the_agent_can_answer():
    error = refused(protocol.decode_command, start_dict(port=0), "port")
    assert (error.kind, error.epoch, error.shard_id) == ("start_shard", 3, 4)
    error = refused(protocol.decode_command, start_dict(epoch="3", shard_id=True), "epoch")
    assert (error.kind, error.epoch, error.shard_id) == ("start_shard", None, None)
    assert isinstance(error, ValueError)


def test_a_struct_built_with_repeated_gpus_is_refused_at_once():
    with pytest.raises(ValueError, match="GPU index 0 is repeated"):
        Heartbeat(gpus=[GPUHealth(index=0, healthy=True)] * 2)


@pytest.mark.parametrize(("text", "port"), [("1", 1), (" 8000 ", 8000), ("65535", 65535), (20000, 20000)])
def test_parse_port_accepts_ports(text, port):
    assert protocol.parse_port(text) == port


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("0", "port 0 is outside 1-65535"),
        ("65536", "port 65536 is outside 1-65535"),
        (-5, "port -5 is outside 1-65535"),
        ("x", "port 'x' is not a number"),
        ("", "port '' is not a number"),
        (True, "port True is not a number"),
    ],
)
def test_parse_port_refuses_naming_the_port(text, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        protocol.parse_port(text)


def test_the_port_type_is_the_same_rule_as_parse_port():
    ports = msgspec.json.Decoder(list[parts.PORT])
    assert ports.decode(b"[1, 65535]") == [1, 65535]
    for bad in (b"[0]", b"[65536]"):
        with pytest.raises(msgspec.ValidationError):
            ports.decode(bad)


@pytest.mark.parametrize(("name", "ok"), [("gpu-07", True), ("a.b_c", True), ("x" * 63, True), ("x" * 64, False),
                                          ("-gpu", False), ("gpu 7", False), ("", False)])  # fmt: skip
def test_node_name_pattern(name, ok):
    assert bool(re.match(protocol.NODE_NAME_PATTERN, name)) is ok


def test_shard_report_states_are_the_states_shard_status_accepts():
    assert protocol.SHARD_REPORT_STATES == ("starting", "ready", "sleeping", "failed", "stopped")
    for state in protocol.SHARD_REPORT_STATES:
        assert protocol.decode_agent_message(protocol.encode(ShardStatus(shard_id=1, state=state))).state == state
