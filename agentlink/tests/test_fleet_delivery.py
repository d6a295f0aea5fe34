"""Delivery at fleet scale on the real Redis channel layer: commands are acknowledged or sent again,
a full channel is an error the sender sees, and a burst of connects never fails on the connection pool.

The live tests run the project's ASGI app under uvicorn in a thread of the test process (so it
shares the test database), with real agents (agent.runtime.Agent, fake GPUs) or raw WebSockets.
"""

import asyncio
import logging
import threading
import time
from datetime import timedelta

import pytest
import redis
import uvicorn
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.db import connections, transaction
from django.utils import timezone
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from agent.gpus.discovery import parse_fake_gpus
from agent.options import AgentOptions
from agent.runtime import Agent
from conftest import free_port, wait_until
from inventory.choices import NodeState
from inventory.models import Node
from inventory.services import enrol_node
from llmgw_site.asgi import application
from llmgw_site.settings import channel_layers
from nodewire.protocol import StopShard, to_builtins
from reconciler.commands import acknowledge, resend_unacknowledged
from reconciler.models import PendingCommand
from reconciler.outbox import Outbox, new_command_id, record_pending

pytestmark = [pytest.mark.redis, pytest.mark.django_db(transaction=True)]


def redis_layer(settings, redis_url, **config):
    """The project's Redis channel layer for this test, with `config` overriding its settings."""
    layers = channel_layers(redis_url)
    layers["default"]["CONFIG"].update(config)
    settings.CHANNEL_LAYERS = layers  # channels drops its cached layer when the setting changes
    return get_channel_layer()


@pytest.fixture
def live_control_plane(settings, redis_url):
    """The control plane's ASGI app served by uvicorn on 127.0.0.1, in a thread; yields a starter."""
    servers = []

    def start(**layer_config):
        redis_layer(settings, redis_url, **layer_config)
        port = free_port()
        config = uvicorn.Config(application, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        wait_until(lambda: server.started, 10)
        return f"ws://127.0.0.1:{port}/agent/ws"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)
    connections.close_all()


def group_members(redis_url) -> dict[str, int]:
    client = redis.Redis.from_url(redis_url)
    try:
        return {key.decode(): client.zcard(key) for key in client.scan_iter(match="llmgw:asgi:group:node.*")}
    finally:
        client.close()


def test_a_full_channel_is_an_error_the_sender_sees_and_the_command_stays_pending(
    settings, redis_url, caplog, django_capture_on_commit_callbacks
):
    layer = redis_layer(settings, redis_url, capacity=1)
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)("node.gpu-a", channel)

    outbox = Outbox(epoch=1)
    outbox.stop("gpu-a", 1)
    outbox.stop("gpu-a", 2)
    capture = django_capture_on_commit_callbacks(execute=True)
    with caplog.at_level(logging.ERROR, logger="reconciler.outbox"), capture, transaction.atomic():
        outbox.send_on_commit()

    # One fits the stream's queue (capacity 1); the other is refused, and the sender says so.
    assert "ChannelFull" in caplog.text and "stays pending" in caplog.text
    assert PendingCommand.objects.count() == 2
    first = async_to_sync(layer.receive)(channel)["command"]
    assert acknowledge("gpu-a", first["cid"])
    # Once there is room, the tick sends the refused one again; nothing was lost.
    with django_capture_on_commit_callbacks(execute=True), transaction.atomic():
        assert resend_unacknowledged(timezone.now() + timedelta(seconds=2)) == 1
    again = async_to_sync(layer.receive)(channel)["command"]
    assert {first["shard_id"], again["shard_id"]} == {1, 2}


def test_a_burst_to_many_streams_reaches_each_its_own_message_and_says_where_nobody_listens(settings, redis_url):
    layer = redis_layer(settings, redis_url)

    async def burst():
        channels = [await layer.new_channel() for _ in range(300)]
        for i, channel in enumerate(channels):
            await layer.group_add(f"node.n{i}", channel)
        items = [(f"node.n{i}", {"type": "agent.command", "command": {"n": i}}) for i in range(300)]
        outcome = await layer.send_to_groups([*items, ("node.gone", {"type": "agent.command", "command": {}})])
        # All 300 wait on one Redis queue (this process's); the receiver takes them in batches.
        received = await asyncio.gather(*(layer.receive(channel) for channel in channels))
        await layer.flush()
        return outcome, received

    outcome, received = async_to_sync(burst)()
    assert [(o.members, o.full, o.delivered) for o in outcome] == [(1, 0, True)] * 300 + [(0, 0, False)]
    assert [m["command"]["n"] for m in received] == list(range(300))


def test_a_dropped_command_is_sent_again_and_acknowledged_within_two_seconds(live_control_plane, redis_url):
    url = live_control_plane()
    _, token = enrol_node("gpu-a")
    ready = Node.objects.filter(name="gpu-a", state=NodeState.READY)

    async def scenario():
        gpus = parse_fake_gpus("1xH100-80GB", "gpu-a")
        agent = Agent(AgentOptions([url], "gpu-a", token, gpus, "127.0.0.1", heartbeat_seconds=1))
        running = asyncio.create_task(agent.run())
        try:
            await wait_for(lambda: ready.exists(), 10)
            # A command the channel layer lost on its way: decided and recorded, never delivered.
            command = to_builtins(StopShard(epoch=1, shard_id=99, cid=new_command_id()))
            await database_sync_to_async(record_pending)([("gpu-a", command)], timezone.now())
            lost_at = time.monotonic()

            # The leader's next tick sends it again; the agent acknowledges it.
            def tick_resend():
                with transaction.atomic():
                    return resend_unacknowledged(timezone.now() + timedelta(seconds=1.3))

            assert await database_sync_to_async(tick_resend)() == 1
            await wait_for(lambda: not PendingCommand.objects.exists(), 2)
            return time.monotonic() - lost_at
        finally:
            await agent.shutdown()
            await running

    assert async_to_sync(scenario)() < 2


def test_a_burst_of_connects_on_a_small_pool_answers_no_500_and_leaves_no_group_member(live_control_plane, redis_url):
    """200 agents connect at once through 4 Redis connections: they wait for one, none fails."""
    url = live_control_plane(pool_size=4)
    tokens = {f"n{i:03d}": enrol_node(f"n{i:03d}")[1] for i in range(200)}

    async def burst():
        async def one(name, token):
            headers = {"Authorization": f"Bearer {token}", "X-Llmgw-Node": name}
            try:
                return await connect(url, additional_headers=headers, open_timeout=30, compression=None)
            except InvalidStatus as exc:
                return exc.response.status_code

        results = await asyncio.gather(*(one(name, token) for name, token in tokens.items()))
        failed = [r for r in results if isinstance(r, int)]
        opened = [r for r in results if not isinstance(r, int)]
        members = group_members(redis_url)
        await asyncio.gather(*(ws.close() for ws in opened))
        return failed, members

    failed, members = async_to_sync(burst)()
    assert failed == []
    assert len(members) == 200 and set(members.values()) == {1}
    # Every stream left its group when it closed: nothing is left to be sent commands meant for another.
    wait_until(lambda: sum(group_members(redis_url).values()) == 0, 10, 0.1, describe=lambda: group_members(redis_url))


async def wait_for(predicate, timeout: float) -> None:
    """Poll a database predicate from async code until it holds; fail after `timeout` seconds."""
    check = database_sync_to_async(predicate)
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.02)
