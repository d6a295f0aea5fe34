"""The agent WebSocket: authentication, validation, registration, command relay."""

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator

from inventory.choices import GPUHealth, NodeState
from inventory.models import GPU, Node
from inventory.services import enrol_node
from llmgw_site.asgi import application
from nodewire import parts, protocol
from reconciler.models import Shard
from reconciler.outbox import send_to_nodes
from tests.fleet import make_model, make_replica

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("close_consumer_connection")]


def hello(node="gpu-a", gpus=2, **extra):
    return {
        "type": "hello",
        "v": parts.PROTOCOL_VERSION,
        "node": node,
        "version": "test",
        "address": "10.0.0.5",
        "fabric": "ib-a",
        "labels": {"rack": "r1"},
        "gpus": [
            {"index": i, "uuid": f"GPU-{node}-{i}", "gpu_class": "H100-80GB", "memory_mb": 81920, "healthy": True}
            for i in range(gpus)
        ],
        "shards": [],
        **extra,
    }


def communicator(node, token):
    headers = []
    if node is not None:
        headers.append((b"x-llmgw-node", node.encode()))
    if token is not None:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    return WebsocketCommunicator(application, "/agent/ws", headers=headers)


async def connect(node, token):
    comm = communicator(node, token)
    # Not the communicator's 1 s: the handshake reads and writes the database (and a second connection closes
    # the first), which a PostgreSQL pass beside two others can take longer than that to do.
    connected, code = await comm.connect(timeout=10)
    return comm, connected, code


@pytest.mark.asyncio
async def test_agent_with_a_wrong_token_is_refused_and_nothing_changes(token):
    comm, connected, code = await connect("gpu-a", token + "x")
    assert not connected
    assert code == protocol.CLOSE_UNAUTHORIZED
    node = await database_sync_to_async(Node.objects.get)(name="gpu-a")
    assert node.state == NodeState.NEW and node.last_seen is None


@pytest.mark.asyncio
async def test_a_credential_cannot_take_over_another_node_name(token):
    await database_sync_to_async(enrol_node)("gpu-b")
    comm, connected, _ = await connect("gpu-b", token)  # gpu-a's token, gpu-b's name
    assert not connected


@pytest.mark.asyncio
async def test_missing_credentials_are_refused():
    comm, connected, code = await connect(None, None)
    assert not connected and code == protocol.CLOSE_UNAUTHORIZED


@pytest.mark.asyncio
async def test_hello_registers_the_node_and_its_gpus(token):
    comm, connected, _ = await connect("gpu-a", token)
    assert connected
    await comm.send_json_to(hello(gpus=8))
    # A heartbeat round-trip proves the hello was processed (messages are handled in order).
    await comm.send_json_to({"type": "heartbeat", "v": 1, "gpus": [], "shards": []})
    await comm.send_json_to({"type": "bogus", "v": 1})
    reply = await comm.receive_json_from(timeout=5)
    assert reply["type"] == "error" and "bogus" in reply["message"]
    node = await database_sync_to_async(Node.objects.get)(name="gpu-a")
    assert node.state == NodeState.READY and node.effective_address == "10.0.0.5" and node.effective_fabric == "ib-a"
    assert (node.labels or node.reported_labels) == {"rack": "r1"}
    assert await database_sync_to_async(GPU.objects.filter(node=node, gpu_class="H100-80GB").count)() == 8
    await comm.disconnect()


@pytest.mark.asyncio
async def test_malformed_messages_get_an_error_and_change_nothing(token):
    comm, connected, _ = await connect("gpu-a", token)
    await comm.send_to(text_data="{not json")
    reply = await comm.receive_json_from(timeout=5)
    assert reply["type"] == "error" and "not JSON" in reply["message"]
    bad = hello()
    bad["gpus"][1]["index"] = 0
    await comm.send_json_to(bad)
    reply = await comm.receive_json_from(timeout=5)
    assert "repeated" in reply["message"]
    await comm.send_json_to(hello(node="gpu-z"))
    reply = await comm.receive_json_from(timeout=5)
    assert "gpu-z" in reply["message"]
    assert await database_sync_to_async(GPU.objects.count)() == 0
    node = await database_sync_to_async(Node.objects.get)(name="gpu-a")
    assert node.state == NodeState.NEW
    await comm.disconnect()


@pytest.mark.asyncio
async def test_a_second_connection_for_the_node_replaces_the_first(token):
    first, connected, _ = await connect("gpu-a", token)
    assert connected
    second, connected, _ = await connect("gpu-a", token)
    assert connected
    closed = await first.receive_output(timeout=5)
    assert closed == {"type": "websocket.close", "code": protocol.CLOSE_SUPERSEDED}
    # Commands now reach the newer stream.
    await get_channel_layer().group_send(
        "node.gpu-a",
        {"type": "agent.command", "command": protocol.to_builtins(protocol.StopShard(epoch=3, shard_id=9))},
    )
    assert (await second.receive_json_from(timeout=5))["shard_id"] == 9
    await second.disconnect()


@pytest.mark.asyncio
async def test_a_heartbeat_joins_the_node_group_again_after_the_layer_forgot_it(token):
    """What a Redis restarted without persistence does to channel-layer groups."""
    comm, connected, _ = await connect("gpu-a", token)
    assert connected
    layer = get_channel_layer()
    for channel in list(layer.groups.get("node.gpu-a", {})):
        await layer.group_discard("node.gpu-a", channel)
    await comm.send_json_to({"type": "heartbeat", "v": 1, "gpus": [], "shards": []})
    await comm.send_json_to({"type": "bogus", "v": 1})  # its error reply proves the heartbeat was handled
    assert (await comm.receive_json_from(timeout=5))["type"] == "error"

    command = protocol.to_builtins(protocol.StopShard(epoch=3, shard_id=9))
    await layer.group_send("node.gpu-a", {"type": "agent.command", "command": command})
    assert (await comm.receive_json_from(timeout=5))["shard_id"] == 9
    await comm.disconnect()


def test_commands_sent_from_sync_code_reach_the_agent(token):
    async def scenario():
        comm, connected, _ = await connect("gpu-a", token)
        assert connected
        failed = await database_sync_to_async(send_to_nodes)(
            [("gpu-a", protocol.to_builtins(protocol.StopShard(epoch=1, shard_id=4, cid="c1")))]
        )
        assert failed == []
        received = await comm.receive_json_from(timeout=5)
        await comm.disconnect()
        return received

    received = async_to_sync(scenario)()
    assert received == {"type": "stop_shard", "v": 1, "epoch": 1, "cid": "c1", "shard_id": 4}


@pytest.mark.asyncio
async def test_heartbeat_health_changes_quarantine_a_recovered_gpu(token):
    comm, connected, _ = await connect("gpu-a", token)
    await comm.send_json_to(hello(gpus=2))
    await comm.send_json_to({"type": "heartbeat", "v": 1, "gpus": [{"index": 1, "healthy": False}], "shards": []})
    await comm.send_json_to({"type": "bogus", "v": 1})
    await comm.receive_json_from(timeout=5)
    gpu = await database_sync_to_async(GPU.objects.get)(index=1)
    assert gpu.health == GPUHealth.UNHEALTHY and gpu.healthy_since is None
    await comm.send_json_to({"type": "heartbeat", "v": 1, "gpus": [{"index": 1, "healthy": True}], "shards": []})
    await comm.send_json_to({"type": "bogus", "v": 1})
    await comm.receive_json_from(timeout=5)
    gpu = await database_sync_to_async(GPU.objects.get)(index=1)
    assert gpu.health == GPUHealth.HEALTHY and gpu.healthy_since is not None
    untouched = await database_sync_to_async(GPU.objects.get)(index=0)
    assert untouched.healthy_since is None
    await comm.disconnect()


@pytest.mark.asyncio
async def test_an_engine_whose_shard_row_is_gone_is_stopped_on_heartbeat(token):
    """Orphans are closed: the replica was deleted (e.g. with its profile) while the agent ran it."""
    comm, connected, _ = await connect("gpu-a", token)
    await comm.send_json_to(hello(gpus=2))
    await comm.send_json_to({"type": "heartbeat", "v": 1, "gpus": [], "shards": [{"shard_id": 77, "state": "ready"}]})
    command = await comm.receive_json_from(timeout=5)
    assert command["type"] == "stop_shard" and command["shard_id"] == 77
    await comm.disconnect()


@pytest.mark.asyncio
async def test_a_heartbeat_records_each_shards_requests_in_flight(token):
    comm, connected, _ = await connect("gpu-a", token)
    await comm.send_json_to(hello(gpus=2))
    await comm.send_json_to({"type": "bogus", "v": 1})  # its error reply proves the hello was handled
    assert (await comm.receive_json_from(timeout=5))["type"] == "error"

    def place_two_shards():
        node = Node.objects.get(name="gpu-a")
        profile = make_model("m", max_replicas=2).profiles.get()
        return [make_replica(profile, placement=[(node, [i])]).shards.get().pk for i in range(2)]

    busy, unknown = await database_sync_to_async(place_two_shards)()
    shards = [{"shard_id": busy, "state": "ready", "running": 2}, {"shard_id": unknown, "state": "ready"}]
    await comm.send_json_to({"type": "heartbeat", "v": 1, "gpus": [], "shards": shards})
    await comm.send_json_to({"type": "bogus", "v": 1})  # its error reply proves the heartbeat was handled
    assert (await comm.receive_json_from(timeout=5))["type"] == "error"
    running = await database_sync_to_async(lambda: dict(Shard.objects.values_list("pk", "running")))()
    assert running == {busy: 2, unknown: None}
    await comm.disconnect()
