"""Over the agent link: hello's weights are stored, remove_weights reaches the agent and its answer is applied,
and a heartbeat reporting a held GPU unhealthy fails the replica and stops its shard."""

import asyncio

import pytest
from channels.db import database_sync_to_async

from agentlink.tests.test_consumer import connect, hello
from inventory.models import Node, Weights
from nodewire import protocol
from reconciler.choices import ReplicaState
from reconciler.models import PendingCommand, Replica
from reconciler.outbox import Outbox
from tests.fleet import make_model, make_replica

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("close_consumer_connection")]


WEIGHTS = [{"source": "org/llama", "path": "/w/hub/models--org--llama", "size_bytes": 123}]


def queue_removal():
    outbox = Outbox(epoch=2)
    outbox.remove_weights("gpu-a", "org/llama", "/w/hub/models--org--llama")
    # Outside a transaction on_commit runs at once: the command leaves now.
    outbox.send_on_commit()


@pytest.mark.asyncio
async def test_weights_reported_at_hello_are_removed_when_the_agent_says_so(token):
    comm, connected, _ = await connect("gpu-a", token)
    assert connected
    await comm.send_json_to(hello(weights=WEIGHTS))
    await comm.send_json_to({"type": "bogus", "v": 1})  # its error reply: the hello has been applied
    assert (await comm.receive_json_from(timeout=5))["type"] == "error"
    await database_sync_to_async(queue_removal)()
    command = await comm.receive_json_from(timeout=5)
    cid = command.pop("cid")  # pending until acknowledged, like every command
    assert command == {"type": "remove_weights", "v": 1, "epoch": 2, **{k: WEIGHTS[0][k] for k in ("source", "path")}}
    assert await database_sync_to_async(PendingCommand.objects.filter(cid=cid).exists)()
    await comm.send_json_to({"type": "ack", "v": 1, "cid": cid})
    rows = await database_sync_to_async(lambda: list(Weights.objects.values_list("source", "size_bytes")))()
    assert rows == [("org/llama", 123)]

    refused = {"source": "org/llama", "path": WEIGHTS[0]["path"], "removed": False, "message": "refused: outside"}
    await comm.send_json_to({"type": "weights_status", "v": 1, **refused})
    await comm.send_json_to({"type": "weights_status", "v": 1, **refused, "removed": True, "message": "removed"})
    await comm.send_json_to({"type": "heartbeat", "v": 1, "gpus": [], "shards": []})
    await comm.send_json_to({"type": "bogus", "v": 1})  # its error reply marks the end of what was processed
    assert (await comm.receive_json_from(timeout=5))["type"] == "error"
    assert not await database_sync_to_async(Weights.objects.exists)()
    await asyncio.sleep(0.3)  # acks are settled in batches, a tenth of a second apart
    assert not await database_sync_to_async(PendingCommand.objects.exists)()
    await comm.disconnect()


@pytest.mark.asyncio
async def test_a_heartbeat_with_a_held_gpu_unhealthy_fails_the_replica_and_stops_its_shard(token):
    comm, connected, _ = await connect("gpu-a", token)
    await comm.send_json_to(hello(gpus=2))
    await comm.send_json_to({"type": "bogus", "v": 1})  # its error reply: the hello has been applied
    assert (await comm.receive_json_from(timeout=5))["type"] == "error"

    def place():
        node = Node.objects.get(name="gpu-a")
        return make_replica(make_model("llama").profiles.get(), placement=[(node, [1])])

    replica = await database_sync_to_async(place)()
    shard = await database_sync_to_async(replica.shards.get)()
    await comm.send_json_to(
        {
            "type": "heartbeat",
            "v": 1,
            "gpus": [{"index": 0, "healthy": True}, {"index": 1, "healthy": False, "reason": "XID 79"}],
            "shards": [{"shard_id": shard.pk, "state": "ready", "running": 0}],
        }
    )
    stop = await comm.receive_json_from(timeout=5)
    assert (stop["type"], stop["shard_id"]) == (protocol.STOP_SHARD, shard.pk)
    replica = await database_sync_to_async(Replica.objects.get)()
    assert replica.state == ReplicaState.FAILED
    assert replica.last_error == "GPU 1 on gpu-a is unhealthy: XID 79"
    await comm.disconnect()
