"""The node agent against a stand-in control plane: a real websockets server on 127.0.0.1.

Engines are the bundled mock engine, started by the agent as real subprocesses.
"""

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from http import HTTPStatus
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.server import serve

from agent import protocol
from agent.gpus import parse_fake_gpus
from agent.runtime import Agent, AgentRejected, AgentSuperseded
from conftest import free_port

NODE = "gpu-test-01"
TOKEN = "llmgw-node-secret"
PROJECT = Path(__file__).resolve().parents[2]


class ControlPlane:
    """A stand-in for /agent/ws that records what the agent says and sends it commands."""

    def __init__(self, reject_status: int | None = None, close_code: int | None = None):
        self.reject_status = reject_status
        self.close_code = close_code
        self.messages: asyncio.Queue = asyncio.Queue()
        self.headers: list[dict] = []
        self.connections = 0
        self.ws = None

    async def __aenter__(self):
        self.server = await serve(self._handler, "127.0.0.1", 0, process_request=self._process_request)
        self.url = f"ws://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/agent/ws"
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()

    def _process_request(self, connection, request):
        self.headers.append({k.lower(): v for k, v in request.headers.raw_items()})
        if self.reject_status is not None:
            return connection.respond(self.reject_status, "refused\n")
        return None

    async def _handler(self, ws):
        self.ws = ws
        self.connections += 1
        if self.close_code is not None:
            await ws.close(self.close_code, "go away")
            return
        with contextlib.suppress(Exception):
            async for raw in ws:
                await self.messages.put(json.loads(raw))

    async def next(self, kind: str, timeout: float = 5.0) -> dict:
        """The next message of `kind`, skipping others (heartbeats arrive all the time)."""
        async with asyncio.timeout(timeout):
            while True:
                message = await self.messages.get()
                if message["type"] == kind:
                    return message

    async def send(self, message: dict) -> None:
        await self.ws.send(json.dumps(message))


def start_command(shard_id: int, port: int, epoch: int = 1, **overrides) -> dict:
    fields = {
        "shard_id": shard_id,
        "replica_id": 70 + shard_id,
        "rank": 0,
        "node_count": 1,
        "head_address": "",
        "engine": "mock",
        "model": "mock-small",
        "source": "mock-small",
        "gpu_indices": [0, 1],
        "port": port,
        "args": [],
        "env": {},
        **overrides,
    }
    return protocol.command(protocol.START_SHARD, epoch, **fields)


def make_agent(control_planes: list[str], **overrides) -> Agent:
    options = {"heartbeat_seconds": 0.1, "health_timeout": 10.0, "stop_grace_seconds": 3.0, **overrides}
    return Agent(control_planes, NODE, TOKEN, parse_fake_gpus("2xH100-80GB", NODE), "127.0.0.1", **options)


def run(coro, timeout: float = 20.0):
    async def bounded():
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def health(port: int) -> int:
    async with httpx.AsyncClient(trust_env=False, timeout=2) as client:
        return (await client.get(f"http://127.0.0.1:{port}/health")).status_code


async def start_ready(cp: ControlPlane, shard_id: int, epoch: int = 1) -> int:
    port = free_port()
    await cp.send(start_command(shard_id, port, epoch))
    starting = await cp.next(protocol.SHARD_STATUS)
    assert (starting["shard_id"], starting["state"]) == (shard_id, "starting")
    ready = await cp.next(protocol.SHARD_STATUS)
    assert (ready["shard_id"], ready["state"], ready["port"]) == (shard_id, "ready", port)
    return port


def test_agent_says_hello_then_starts_a_shard_reports_ready_and_stops_it():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            hello = protocol.parse_agent_message(await cp.next(protocol.HELLO))
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
            heartbeat = protocol.parse_agent_message(await cp.next(protocol.HEARTBEAT))
            assert heartbeat["shards"] == [{"shard_id": 1, "state": "ready"}]
            assert agent.running_shards() == [{"shard_id": 1, "replica_id": 71, "state": "ready", "port": port}]

            await cp.send(protocol.command(protocol.STOP_SHARD, 1, shard_id=1))
            stopped = protocol.parse_agent_message(await cp.next(protocol.SHARD_STATUS))
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
            await cp.send(protocol.command(protocol.STOP_SHARD, 4, shard_id=3))
            await cp.send(start_command(4, free_port(), epoch=4))
            # The current leader's next command is answered first: the stale ones did nothing.
            await cp.send(protocol.command(protocol.STOP_SHARD, 5, shard_id=99))
            status = await cp.next(protocol.SHARD_STATUS)
            assert (status["shard_id"], status["state"]) == (99, "stopped")
            assert agent.highest_epoch == 5
            assert agent.running_shards() == [{"shard_id": 3, "replica_id": 73, "state": "ready", "port": port}]
            assert not process_gone(pid)
            assert "epoch 4 is older than epoch 5" in caplog.text

            # A newer leader is obeyed.
            await cp.send(protocol.command(protocol.STOP_SHARD, 6, shard_id=3))
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
            await cp.send({"type": "remove_weights", "v": 1, "epoch": 1})
            await cp.send(protocol.command(protocol.STOP_SHARD, 7, shard_id=98))
            assert (await cp.next(protocol.SHARD_STATUS))["shard_id"] == 98
            # A malformed start from a deposed leader is not answered: only current leaders are.
            await cp.send(start_command(20, 0, epoch=6))
            await cp.send(protocol.command(protocol.STOP_SHARD, 7, shard_id=99))
            assert (await cp.next(protocol.SHARD_STATUS))["shard_id"] == 99
            await agent.shutdown()
            await task

    run(scenario())
    assert "message is not JSON" in caplog.text
    assert "unknown message type 'remove_weights'" in caplog.text
    assert "epoch 6 is older than epoch 7" in caplog.text


def test_engine_that_exits_while_starting_reports_failed_with_its_last_output():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            await cp.send(start_command(5, free_port(), args=["--no-such-flag"]))
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "starting"
            failed = protocol.parse_agent_message(await cp.next(protocol.SHARD_STATUS))
            assert (failed["shard_id"], failed["state"]) == (5, "failed")
            assert "exited with code 2" in failed["message"]
            assert "unrecognized arguments: --no-such-flag" in failed["message"]
            assert agent.running_shards() == []
            await agent.shutdown()
            await task

    run(scenario())


def test_engine_that_dies_after_ready_reports_failed():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            await start_ready(cp, shard_id=6)
            os.kill(agent.engine_pid(6), signal.SIGKILL)
            failed = await cp.next(protocol.SHARD_STATUS)
            assert (failed["shard_id"], failed["state"]) == (6, "failed")
            assert "exited with code -9" in failed["message"]
            assert agent.running_shards() == []
            await agent.shutdown()
            await task

    run(scenario())


def test_engine_not_healthy_in_time_is_stopped_and_reported_failed():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url], health_timeout=0.01)
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            await cp.send(start_command(7, free_port()))
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "starting"
            failed = await cp.next(protocol.SHARD_STATUS)
            assert (failed["shard_id"], failed["state"]) == (7, "failed")
            assert "did not become healthy within 0.01 s" in failed["message"]
            assert agent.running_shards() == []
            await agent.shutdown()
            await task

    run(scenario())


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
            await agent.shutdown()
            await task

    run(scenario())


def test_handshake_refused_with_403_raises_agent_rejected():
    async def scenario():
        async with ControlPlane(reject_status=HTTPStatus.FORBIDDEN) as cp:
            with pytest.raises(AgentRejected, match="refused node “gpu-test-01” \\(HTTP 403\\)"):
                await make_agent([cp.url]).run()
            assert cp.connections == 0

    run(scenario())


def test_close_code_unauthorized_raises_agent_rejected():
    async def scenario():
        async with ControlPlane(close_code=protocol.CLOSE_UNAUTHORIZED) as cp:
            with pytest.raises(AgentRejected, match="not authorised"):
                await make_agent([cp.url]).run()

    run(scenario())


def test_close_code_superseded_stops_the_agent_and_its_engines():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            await start_ready(cp, shard_id=10)
            pid = agent.engine_pid(10)
            await cp.ws.close(protocol.CLOSE_SUPERSEDED, "replaced")
            with pytest.raises(AgentSuperseded, match="another agent connected as node"):
                await task
            assert process_gone(pid)

    run(scenario())


def test_lost_connection_is_retried_on_the_next_control_plane_and_hello_reports_running_shards():
    async def scenario():
        async with ControlPlane() as first, ControlPlane() as second:
            dead = f"ws://127.0.0.1:{free_port()}/agent/ws"
            agent = make_agent([first.url, dead, second.url])
            task = asyncio.create_task(agent.run())
            await first.next(protocol.HELLO)
            port = await start_ready(first, shard_id=11)
            # The first control plane goes away; the agent skips the dead one and reaches the second.
            first.server.close()
            hello = protocol.parse_agent_message(await second.next(protocol.HELLO, timeout=8))
            assert hello["shards"] == [{"shard_id": 11, "replica_id": 81, "state": "ready", "port": port}]
            assert await health(port) == 200
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


AGENT_SCRIPT = """
import asyncio, sys
from agent.gpus import parse_fake_gpus
from agent.runtime import Agent
asyncio.run(Agent([sys.argv[1]], "n", "t", parse_fake_gpus("1xL4-24GB", "n"), "127.0.0.1").run())
"""


def test_engines_die_with_the_agent_even_when_it_is_killed():
    async def scenario():
        async with ControlPlane() as cp:
            agent_process = subprocess.Popen([sys.executable, "-c", AGENT_SCRIPT, cp.url], cwd=PROJECT)
            try:
                await cp.next(protocol.HELLO, timeout=10)
                port = free_port()
                await cp.send(start_command(14, port, gpu_indices=[0]))
                await cp.next(protocol.SHARD_STATUS)
                assert (await cp.next(protocol.SHARD_STATUS))["state"] == "ready"
                agent_process.kill()
                agent_process.wait(5)
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    try:
                        await health(port)
                    except httpx.ConnectError:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError("the engine outlived its agent")
            finally:
                agent_process.kill()
                agent_process.wait(5)

    run(scenario())
