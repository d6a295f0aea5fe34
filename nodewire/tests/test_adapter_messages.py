"""The LoRA part of the agent protocol: load_adapter, unload_adapter, adapter_status and heartbeat's
`shards[].adapters` (nodewire/adapter_messages.py), through both ends' gates."""

import json

import pytest

from nodewire import parts, protocol
from nodewire.adapter_messages import AdapterStatus, LoadAdapter, UnloadAdapter


def frame(**fields) -> bytes:
    return json.dumps({"v": 1, **fields}).encode()


def test_load_and_unload_round_trip_through_the_agents_gate():
    load = LoadAdapter(epoch=3, cid="a1", shard_id=7, name="sql-helper", source="/adapters/sql")
    assert protocol.decode_command(protocol.encode(load)) == load
    unload = UnloadAdapter(epoch=3, cid="a2", shard_id=7, name="sql-helper")
    assert protocol.decode_command(protocol.encode(unload)) == unload
    # The command id is optional, as on every command.
    assert protocol.decode_command(frame(type="unload_adapter", epoch=1, shard_id=7, name="x")).cid == ""
    assert protocol.to_builtins(load) == {
        "type": "load_adapter", "v": 1, "epoch": 3, "cid": "a1", "shard_id": 7, "name": "sql-helper",
        "source": "/adapters/sql",
    }  # fmt: skip


def test_adapter_status_round_trips_through_the_control_planes_gate():
    loaded = AdapterStatus(shard_id=7, name="sql-helper", state="loaded", seconds=1.25)
    assert protocol.decode_agent_message(protocol.encode(loaded)) == loaded
    failed = AdapterStatus(shard_id=7, name="sql-helper", state="failed", message="POST … answered HTTP 500: boom")
    decoded = protocol.decode_agent_message(protocol.encode(failed))
    assert (decoded.state, decoded.message, decoded.seconds) == ("failed", failed.message, None)


def test_a_heartbeat_carries_each_engines_adapters_only_where_it_takes_them():
    beat = protocol.Heartbeat(
        gpus=[],
        shards=[
            parts.ShardHeartbeat(shard_id=1, state="ready", running=0, adapters=["a", "b"]),
            parts.ShardHeartbeat(shard_id=2, state="ready", running=0, adapters=[]),
            parts.ShardHeartbeat(shard_id=3, state="ready", running=0),
        ],
    )
    shards = protocol.to_builtins(protocol.decode_agent_message(protocol.encode(beat)))["shards"]
    assert [s.get("adapters") for s in shards] == [["a", "b"], [], None]
    assert "adapters" not in shards[2]


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"type": "load_adapter", "shard_id": 7, "name": "a"}, "load_adapter: Object missing required field `source`"),
        ({"type": "load_adapter", "shard_id": 7, "name": "", "source": "s"},
         "load_adapter: Expected `str` of length >= 1 - at `$.name`"),
        ({"type": "load_adapter", "shard_id": 7, "name": "a", "source": ""},
         "load_adapter: Expected `str` of length >= 1 - at `$.source`"),
        ({"type": "load_adapter", "shard_id": 7, "name": "a", "source": "s" * 501},
         "load_adapter: Expected `str` of length <= 500 - at `$.source`"),
        ({"type": "unload_adapter", "shard_id": "seven", "name": "a"},
         "unload_adapter: Expected `int`, got `str` - at `$.shard_id`"),
        ({"type": "unload_adapter", "shard_id": 7, "name": "n" * 201},
         "unload_adapter: Expected `str` of length <= 200 - at `$.name`"),
    ],
)  # fmt: skip
def test_malformed_adapter_commands_are_refused_naming_the_field_and_keep_what_can_be_read(fields, problem):
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.decode_command(frame(epoch=4, cid="c5", **fields))
    assert str(refused.value) == problem
    assert (refused.value.kind, refused.value.epoch, refused.value.cid) == (fields["type"], 4, "c5")


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"state": "loading"}, "adapter_status: Invalid enum value 'loading' - at `$.state`"),
        ({"state": "loaded", "seconds": -1}, "adapter_status: Expected `float` >= 0.0 - at `$.seconds`"),
        ({"state": "loaded", "name": ""}, "adapter_status: Expected `str` of length >= 1 - at `$.name`"),
    ],
)
def test_malformed_adapter_status_is_refused_naming_the_field(fields, problem):
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.decode_agent_message(frame(**{"type": "adapter_status", "shard_id": 7, "name": "a", **fields}))
    assert str(refused.value) == problem


def test_a_heartbeat_with_a_bad_adapter_name_is_refused_naming_where():
    beat = {"type": "heartbeat", "gpus": [], "shards": [{"shard_id": 1, "state": "ready", "adapters": ["a", 5]}]}
    with pytest.raises(protocol.ProtocolError, match=r"Expected `str`, got `int` - at `\$.shards\[0\].adapters\[1\]`"):
        protocol.decode_agent_message(frame(**beat))
