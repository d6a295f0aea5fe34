"""Engines listen on the node's management address only (start_shard's `host`, else the agent's --address)."""

import asyncio
import socket

import httpx
import pytest

from agent.engines.launch import ENGINES, build_launch
from agent.gpus.discovery import parse_fake_gpus
from agent.options import AgentOptions
from agent.runtime import Agent
from agent.tests.stand_ins import NODE, TOKEN, ControlPlane, run, start_command
from conftest import free_port
from nodewire import protocol


def reachable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, port)) == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_is_told_to_listen_on_the_given_host(engine):
    launch = build_launch(
        engine,
        model="m",
        source="/models/m",
        port=20000,
        gpu_indices=[0],
        rank=0,
        node_count=1,
        head_address="",
        args=[],
        host="10.1.2.3",
    )
    at = launch.argv.index("--host")
    assert launch.argv[at + 1] == "10.1.2.3" and "0.0.0.0" not in launch.argv
    assert launch.host == "10.1.2.3"


@pytest.mark.parametrize("host", ["", "-x", "10.0.0.1 --foo", None])
def test_a_host_that_is_not_an_address_is_refused(host):
    with pytest.raises(ValueError, match="host to listen on"):
        build_launch(
            "mock", model="m", source="m", port=20000, gpu_indices=[], rank=0, node_count=1, head_address="", args=[],
            host=host,
        )  # fmt: skip


@pytest.mark.parametrize(("command_host", "agent_address"), [("127.0.0.2", "127.0.0.1"), ("", "127.0.0.2")])
def test_mock_engine_listens_only_on_the_management_address(command_host, agent_address):
    """The start's host wins; without one the agent's --address is used. Nothing answers on other addresses."""

    async def scenario():
        async with ControlPlane() as cp:
            agent = Agent(AgentOptions(
                [cp.url], NODE, TOKEN, parse_fake_gpus("2xH100-80GB", NODE), agent_address,
                heartbeat_seconds=0.1, health_timeout=10.0, stop_grace_seconds=3.0,
            ))  # fmt: skip
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = free_port()
            await cp.send(start_command(5, port, host=command_host))
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "starting"
            ready = await cp.next(protocol.SHARD_STATUS)
            assert ready["state"] == "ready", ready
            async with httpx.AsyncClient(trust_env=False, timeout=2) as client:
                assert (await client.get(f"http://127.0.0.2:{port}/health")).status_code == 200
            assert not reachable("127.0.0.1", port)
            # The agent reads the engine's load where it listens: a heartbeat reports a number, not unknown.
            for _ in range(50):
                beat = await cp.next(protocol.HEARTBEAT)
                if beat["shards"] and beat["shards"][0]["running"] is not None:
                    break
            assert beat["shards"][0]["running"] == 0
            await agent.shutdown()
            await task

    run(scenario())
