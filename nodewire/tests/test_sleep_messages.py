"""The hibernate tier's part of the agent protocol: sleep_shard, wake_shard, start_shard's sleep_mode, and
shard_status's `sleeping`, `seconds` and `sleep_level` (nodewire/protocol.py)."""

import json

import pytest

from nodewire import protocol
from nodewire.protocol import ShardStatus, SleepShard, StartShard, WakeShard


def command(**fields) -> bytes:
    return json.dumps({"v": 1, **fields}).encode()


def test_sleep_and_wake_decode_with_their_defaults():
    sleep = protocol.decode_command(command(type="sleep_shard", epoch=4, cid="c1", shard_id=9, level=2))
    assert sleep == SleepShard(epoch=4, cid="c1", shard_id=9, level=2, timeout_seconds=300.0)
    assert protocol.decode_command(command(type="sleep_shard", epoch=4, shard_id=9)).level == 1
    wake = protocol.decode_command(command(type="wake_shard", epoch=4, cid="c2", shard_id=9))
    assert wake == WakeShard(epoch=4, cid="c2", shard_id=9)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"level": 3}, "sleep_shard: Invalid enum value 3 - at `$.level`"),
        ({"level": 0}, "sleep_shard: Invalid enum value 0 - at `$.level`"),
        ({"level": "1"}, "sleep_shard: Expected `int`, got `str` - at `$.level`"),
        ({"timeout_seconds": -1}, "sleep_shard: Expected `float` >= 0.0 - at `$.timeout_seconds`"),
        ({"shard_id": "nine"}, "sleep_shard: Expected `int`, got `str` - at `$.shard_id`"),
    ],
)
def test_bad_sleep_commands_are_refused_naming_the_field(fields, problem):
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.decode_command(command(**{"type": "sleep_shard", "epoch": 1, "shard_id": 9, **fields}))
    assert str(refused.value) == problem


def test_a_wake_without_its_shard_is_refused_and_the_refusal_keeps_the_command_id():
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.decode_command(command(type="wake_shard", epoch=2, cid="c9"))
    assert str(refused.value) == "wake_shard: Object missing required field `shard_id`"
    assert (refused.value.kind, refused.value.epoch, refused.value.cid) == ("wake_shard", 2, "c9")


def test_start_shard_sleep_mode_is_optional_left_out_unless_set_and_must_be_a_boolean():
    start = {"type": "start_shard", "epoch": 1, "shard_id": 1, "engine": "vllm", "model": "m", "source": "m",
             "gpu_indices": [0], "port": 20000}  # fmt: skip
    assert protocol.decode_command(command(**start)).able_to_sleep is False
    assert protocol.decode_command(command(**start, sleep_mode=False)).able_to_sleep is False
    assert protocol.decode_command(command(**start, sleep_mode=True)).able_to_sleep is True
    # A start that does not ask for it has the shape starts had before it (control planes may compare them).
    plain = StartShard(epoch=1, shard_id=1, engine="vllm", model="m", source="m", gpu_indices=[0], port=20000)
    assert "sleep_mode" not in protocol.to_builtins(plain)
    asked = StartShard(epoch=1, shard_id=1, engine="vllm", model="m", source="m", gpu_indices=[0], port=20000,
                       sleep_mode=True)  # fmt: skip
    assert protocol.to_builtins(asked)["sleep_mode"] is True
    with pytest.raises(protocol.ProtocolError, match=r"Expected `bool`, got `str` - at `\$.sleep_mode`"):
        protocol.decode_command(command(**start, sleep_mode="yes"))
    assert isinstance(protocol.decode_command(command(**start)), StartShard)


def test_a_sleeping_status_carries_its_level_and_how_long_it_took():
    status = ShardStatus(shard_id=3, state="sleeping", seconds=1.25, sleep_level=2)
    assert protocol.decode_agent_message(protocol.encode(status)) == status
    old = {"type": "shard_status", "v": 1, "shard_id": 3, "state": "ready", "port": 20001}
    decoded = protocol.decode_agent_message(json.dumps(old))
    assert (decoded.seconds, decoded.sleep_level) == (None, None)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"seconds": -0.5}, "shard_status: Expected `float` >= 0.0 - at `$.seconds`"),
        ({"sleep_level": 3}, "shard_status: Invalid enum value 3 - at `$.sleep_level`"),
        ({"state": "asleep"}, "shard_status: Invalid enum value 'asleep' - at `$.state`"),
    ],
)
def test_bad_sleep_reports_are_refused_naming_the_field(fields, problem):
    message = {"type": "shard_status", "v": 1, "shard_id": 3, "state": "sleeping", **fields}
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.decode_agent_message(json.dumps(message))
    assert str(refused.value) == problem
