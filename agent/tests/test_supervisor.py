"""Engine supervision: failures reported with the engine's last words, and no engine outlives its agent."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from agent.tests.stand_ins import ControlPlane, checked, health, make_agent, run, start_command, start_ready
from conftest import free_port
from nodewire import protocol

PROJECT = Path(__file__).resolve().parents[2]


def test_engine_that_exits_while_starting_reports_failed_with_its_last_output():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            await cp.send(start_command(5, free_port(), args=["--no-such-flag"]))
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "starting"
            failed = checked(await cp.next(protocol.SHARD_STATUS))
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


AGENT_SCRIPT = """
import asyncio, sys
from agent.gpus.discovery import parse_fake_gpus
from agent.runtime import Agent, AgentOptions
asyncio.run(Agent(AgentOptions([sys.argv[1]], "n", "t", parse_fake_gpus("1xL4-24GB", "n"), "127.0.0.1")).run())
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
