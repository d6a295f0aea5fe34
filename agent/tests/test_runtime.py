"""The node agent's command handling against a stand-in control plane: shards, fencing, refusals, shutdown."""

import asyncio
import logging

import httpx
import pytest

from agent.tests.stand_ins import (
    NODE,
    TOKEN,
    ControlPlane,
    checked,
    command,
    fresh_heartbeat,
    health,
    make_agent,
    process_gone,
    run,
    start_command,
    start_ready,
)
from conftest import free_port
from nodewire import protocol


def test_agent_says_hello_then_starts_a_shard_reports_ready_and_stops_it():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            hello = checked(await cp.next(protocol.HELLO))
            assert hello["node"] == NODE and hello["address"] == "127.0.0.1" and hello["shards"] == []
            assert [(g["index"], g["gpu_class"], g["memory_mb"]) for g in hello["gpus"]] == [
                (0, "H100-80GB", 81920),
                (1, "H100-80GB", 81920),
            ]
            assert cp.headers[0]["authorization"] == f"Bearer {TOKEN}"
            assert cp.headers[0]["x-llmgw-node"] == NODE

            port = await start_ready(cp, shard_id=1)
            assert await health(port) == 200
            pid = agent.engine_pid(1)
            # A heartbeat built while the shard was starting reports it ready with its load unknown.
            heartbeat = await fresh_heartbeat(cp)
            assert heartbeat["shards"] == [{"shard_id": 1, "state": "ready", "running": 0}]
            assert agent.running_shards() == [{"shard_id": 1, "replica_id": 71, "state": "ready", "port": port}]

            await cp.send(command(protocol.STOP_SHARD, 1, shard_id=1))
            stopped = checked(await cp.next(protocol.SHARD_STATUS))
            assert (stopped["shard_id"], stopped["state"]) == (1, "stopped")
            assert process_gone(pid)
            assert agent.running_shards() == []
            with pytest.raises(httpx.ConnectError):
                await health(port)

            await agent.shutdown()
            await task

    run(scenario())


def test_resent_start_for_a_running_shard_reports_its_status_without_a_second_engine():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = await start_ready(cp, shard_id=2)
            pid = agent.engine_pid(2)
            await cp.send(start_command(2, port))
            again = await cp.next(protocol.SHARD_STATUS)
            assert (again["shard_id"], again["state"], again["port"]) == (2, "ready", port)
            assert agent.engine_pid(2) == pid and len(agent.running_shards()) == 1
            await agent.shutdown()
            await task
            assert process_gone(pid)

    run(scenario())


def test_commands_with_an_older_epoch_are_refused(caplog):
    caplog.set_level(logging.WARNING, logger="agent.runtime")

    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = await start_ready(cp, shard_id=3, epoch=5)
            pid = agent.engine_pid(3)

            # A deposed leader (epoch 4) tries to stop the shard and start another.
            await cp.send(command(protocol.STOP_SHARD, 4, shard_id=3))
            await cp.send(start_command(4, free_port(), epoch=4))
            # The current leader's next command is answered first: the stale ones did nothing.
            await cp.send(command(protocol.STOP_SHARD, 5, shard_id=99))
            status = await cp.next(protocol.SHARD_STATUS)
            assert (status["shard_id"], status["state"]) == (99, "stopped")
            assert agent.highest_epoch == 5
            assert agent.running_shards() == [{"shard_id": 3, "replica_id": 73, "state": "ready", "port": port}]
            assert not process_gone(pid)
            assert "epoch 4 is older than epoch 5" in caplog.text

            # A newer leader is obeyed.
            await cp.send(command(protocol.STOP_SHARD, 6, shard_id=3))
            status = await cp.next(protocol.SHARD_STATUS)
            assert (status["shard_id"], status["state"]) == (3, "stopped")
            await agent.shutdown()
            await task

    run(scenario())


def test_error_from_the_control_plane_is_logged(caplog):
    caplog.set_level(logging.ERROR, logger="agent.runtime")

    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            await cp.send({"type": protocol.ERROR, "v": 1, "message": "hello names the wrong node"})
            await cp.next(protocol.HEARTBEAT)
            await agent.shutdown()
            await task

    run(scenario())
    assert "control plane reported an error: hello names the wrong node" in caplog.text


def test_frames_that_are_not_current_commands_are_ignored_and_logged(caplog):
    caplog.set_level(logging.WARNING, logger="agent.runtime")

    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            await cp.ws.send("{not json")
            await cp.send({"type": "resize_disk", "v": 1, "epoch": 1})
            await cp.send(command(protocol.STOP_SHARD, 7, shard_id=98))
            assert (await cp.next(protocol.SHARD_STATUS))["shard_id"] == 98
            # A malformed start from a deposed leader is not answered: only current leaders are.
            await cp.send(start_command(20, 0, epoch=6))
            await cp.send(command(protocol.STOP_SHARD, 7, shard_id=99))
            assert (await cp.next(protocol.SHARD_STATUS))["shard_id"] == 99
            await agent.shutdown()
            await task

    run(scenario())
    assert "message is not JSON" in caplog.text
    assert "unknown message type 'resize_disk'" in caplog.text
    assert "epoch 6 is older than epoch 7" in caplog.text


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"gpu_indices": [0, 5]}, "GPU indices [5] are not on node"),
        ({"engine": "tgi"}, "unknown engine 'tgi'"),
        ({"args": "--max-model-len 8192"}, "not a shell string"),
    ],
)
def test_start_that_cannot_run_here_fails_naming_the_problem(overrides, problem):
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            await cp.send(start_command(8, free_port(), **overrides))
            failed = await cp.next(protocol.SHARD_STATUS)
            assert failed["state"] == "failed" and problem in failed["message"]
            await agent.shutdown()
            await task

    run(scenario())


def test_start_on_a_port_in_use_fails_without_starting_an_engine():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            taken = cp.server.sockets[0].getsockname()[1]
            await cp.send(start_command(9, taken))
            failed = await cp.next(protocol.SHARD_STATUS)
            assert failed["state"] == "failed" and f"port {taken} is already in use" in failed["message"]
            assert (failed["port"], failed["port_busy"]) == (taken, True)
            await agent.shutdown()
            await task

    run(scenario())


def test_shutdown_stops_every_engine_and_is_safe_to_call_twice():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            await start_ready(cp, shard_id=12)
            await start_ready(cp, shard_id=13)
            pids = [agent.engine_pid(12), agent.engine_pid(13)]
            await asyncio.gather(agent.shutdown(), agent.shutdown())
            await agent.shutdown()
            await task
            assert all(process_gone(pid) for pid in pids)
            assert agent.running_shards() == []

    run(scenario())


def test_every_command_with_an_id_is_acknowledged_before_it_is_carried_out_and_a_stale_one_as_refused():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            await cp.send(command(protocol.STOP_SHARD, 5, shard_id=9, cid="c-stop"))
            ack = await cp.next(protocol.ACK)
            assert checked(ack) == {"type": "ack", "v": 1, "cid": "c-stop", "refused": False, "message": ""}
            status = await cp.next(protocol.SHARD_STATUS)
            assert (status["shard_id"], status["state"]) == (9, "stopped")

            # A deposed leader's command is answered too, as refused, so it is not sent again forever.
            await cp.send(command(protocol.STOP_SHARD, 4, shard_id=9, cid="c-stale"))
            ack = await cp.next(protocol.ACK)
            assert (ack["cid"], ack["refused"]) == ("c-stale", True)
            assert "epoch 4 is older than epoch 5" in ack["message"]

            # A malformed command that names its id is refused with the reason: sending it again would not help.
            bad = command(protocol.STOP_SHARD, 5, shard_id=9, cid="c-bad") | {"shard_id": "nine"}
            await cp.send(bad)
            ack = await cp.next(protocol.ACK)
            assert (ack["cid"], ack["refused"]) == ("c-bad", True) and "malformed" in ack["message"]
            await agent.shutdown()
            await task

    run(scenario())


def test_a_resent_start_is_acknowledged_again_and_answered_without_a_second_engine():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = await start_ready(cp, shard_id=2)
            pid = agent.engine_pid(2)
            again = start_command(2, port) | {"cid": "c-again"}
            await cp.send(again)
            await cp.send(again)
            for _ in range(2):
                assert (await cp.next(protocol.ACK))["cid"] == "c-again"
            status = await cp.next(protocol.SHARD_STATUS)
            assert (status["shard_id"], status["state"]) == (2, "ready")
            assert agent.engine_pid(2) == pid and len(agent.running_shards()) == 1
            await agent.shutdown()
            await task
            assert process_gone(pid)

    run(scenario())
