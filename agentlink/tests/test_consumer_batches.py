"""What the agent stream batches: heartbeats' `last_seen`, unchanged heartbeats, and acks."""

import asyncio
from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from django.utils import timezone

from agentlink.tests.test_consumer import connect, hello
from inventory.choices import GPUHealth
from inventory.models import GPU, Node
from nodewire import protocol
from reconciler.models import PendingCommand
from reconciler.outbox import new_command_id, record_pending

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("close_consumer_connection")]

BEAT = {"type": "heartbeat", "v": 1, "gpus": [{"index": 0, "healthy": True}], "shards": []}


async def greeted(token):
    """A stream for gpu-a whose hello (one GPU) is recorded."""
    comm, _, _ = await connect("gpu-a", token)
    await comm.send_json_to(hello(gpus=1))
    await handled(comm)
    return comm


async def handled(comm) -> None:
    """Wait until every message sent so far was handled (an invalid one's error reply comes after them)."""
    await comm.send_json_to({"type": "bogus", "v": 1})
    assert (await comm.receive_json_from(timeout=5))["type"] == "error"


@pytest.mark.asyncio
async def test_last_seen_is_written_within_the_flush_interval_not_at_each_heartbeat(token, settings):
    settings.LLMGW_LAST_SEEN_FLUSH_SECONDS = 0.3
    comm = await greeted(token)
    node = database_sync_to_async(Node.objects.get)
    stale = timezone.now() - timedelta(seconds=60)
    await database_sync_to_async(Node.objects.update)(last_seen=stale)

    await comm.send_json_to(BEAT)
    await handled(comm)
    assert (await node(name="gpu-a")).last_seen == stale  # not yet: batched
    await asyncio.sleep(0.6)
    assert (await node(name="gpu-a")).last_seen > stale + timedelta(seconds=59)
    await comm.disconnect()


@pytest.mark.asyncio
async def test_an_unchanged_heartbeat_is_checked_against_the_tables_only_every_recheck_interval(token, settings):
    settings.LLMGW_HEARTBEAT_RECHECK_SECONDS = 60
    comm, _, _ = await connect("gpu-a", token)
    await comm.send_json_to(hello(gpus=1))
    await comm.send_json_to(BEAT)
    await handled(comm)
    gpu = database_sync_to_async(GPU.objects.get)
    # Something else changed the table: the same heartbeat again does not look (that is its saving)…
    await database_sync_to_async(GPU.objects.update)(health=GPUHealth.UNHEALTHY)
    await comm.send_json_to(BEAT)
    await handled(comm)
    assert (await gpu(index=0)).health == GPUHealth.UNHEALTHY
    # …a changed heartbeat does…
    await comm.send_json_to({**BEAT, "gpus": [{"index": 0, "healthy": False}]})
    await comm.send_json_to(BEAT)
    await handled(comm)
    assert (await gpu(index=0)).health == GPUHealth.HEALTHY
    # …and so does the same one once the recheck interval has passed.
    await database_sync_to_async(GPU.objects.update)(health=GPUHealth.UNHEALTHY)
    settings.LLMGW_HEARTBEAT_RECHECK_SECONDS = 0
    await comm.send_json_to(BEAT)
    await handled(comm)
    assert (await gpu(index=0)).health == GPUHealth.HEALTHY
    await comm.disconnect()


@pytest.mark.asyncio
async def test_a_first_heartbeat_saying_what_the_hello_said_is_not_checked_again(token, settings):
    """The hello has just recorded the GPUs: a connect storm's first heartbeats cost no query."""
    settings.LLMGW_HEARTBEAT_RECHECK_SECONDS = 60
    comm = await greeted(token)
    await database_sync_to_async(GPU.objects.update)(health=GPUHealth.UNHEALTHY)  # changed behind its back
    await comm.send_json_to(BEAT)
    await handled(comm)
    assert (await database_sync_to_async(GPU.objects.get)(index=0)).health == GPUHealth.UNHEALTHY
    # One that says otherwise is checked.
    await comm.send_json_to({**BEAT, "gpus": [{"index": 0, "healthy": True, "reason": "x"}]})
    await handled(comm)
    assert (await database_sync_to_async(GPU.objects.get)(index=0)).health == GPUHealth.HEALTHY
    await comm.disconnect()


@pytest.mark.asyncio
async def test_an_ack_settles_the_pending_command_within_a_fraction_of_a_second(token):
    comm, _, _ = await connect("gpu-a", token)
    cid = new_command_id()
    stop = protocol.to_builtins(protocol.StopShard(epoch=1, shard_id=5, cid=cid))
    await database_sync_to_async(record_pending)([("gpu-a", stop), ("gpu-b", {**stop, "cid": "other"})], timezone.now())
    await comm.send_json_to({"type": "ack", "v": 1, "cid": cid})
    await comm.send_json_to({"type": "ack", "v": 1, "cid": "other"})  # another node's command: not this one's to settle
    await handled(comm)
    await asyncio.sleep(0.3)
    left = await database_sync_to_async(lambda: list(PendingCommand.objects.values_list("cid", flat=True)))()
    assert left == ["other"]
    await comm.disconnect()


@pytest.mark.asyncio
async def test_a_node_running_shards_is_checked_at_every_heartbeat_so_an_orphan_is_stopped_at_once(token, settings):
    settings.LLMGW_HEARTBEAT_RECHECK_SECONDS = 60
    comm, _, _ = await connect("gpu-a", token)
    beat = {**BEAT, "shards": [{"shard_id": 77, "state": "ready"}]}
    await comm.send_json_to(beat)
    assert (await comm.receive_json_from(timeout=5))["shard_id"] == 77  # no row holds it: stopped
    # The same heartbeat again (the stop was lost, say): checked again, stopped again.
    await comm.send_json_to(beat)
    stop = await comm.receive_json_from(timeout=5)
    assert (stop["type"], stop["shard_id"]) == ("stop_shard", 77)
    await comm.disconnect()
