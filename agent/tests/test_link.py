"""The agent's link to the control plane: rejection, replacement by a newer agent, rotation after a loss."""

import asyncio
from http import HTTPStatus

import pytest

from agent.link import AgentRejected, AgentSuperseded, ControlPlaneLink
from agent.tests.stand_ins import ControlPlane, checked, health, make_agent, process_gone, run, start_ready
from conftest import free_port
from nodewire import protocol


@pytest.mark.parametrize("uri", ["http://cp/agent/ws", "ws://", "wss:///agent/ws", "cp:8000/agent/ws"])
def test_the_link_refuses_an_address_the_agent_command_refuses(uri):
    with pytest.raises(ValueError, match="must be a ws:// or wss:// URL"):
        ControlPlaneLink([uri], "n1", "t", 1.0)


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
            hello = checked(await second.next(protocol.HELLO, timeout=8))
            assert hello["shards"] == [{"shard_id": 11, "replica_id": 81, "state": "ready", "port": port}]
            assert await health(port) == 200
            await agent.shutdown()
            await task

    run(scenario())


def test_messages_are_sent_as_json_text_frames():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            await cp.next(protocol.HEARTBEAT)
            await agent.shutdown()
            await task
            assert cp.frame_types == {str}

    run(scenario())


def test_heartbeats_are_jittered_so_a_fleet_that_connected_together_does_not_beat_together():
    firsts, laters = [], []
    for _ in range(200):
        delays = ControlPlaneLink(["ws://127.0.0.1:1/agent/ws"], "n1", "t", 5.0).heartbeat_delays()
        firsts.append(next(delays))
        laters += [next(delays) for _ in range(5)]
    assert all(0 <= d < 5.0 for d in firsts)
    # Spread over the whole first interval, not bunched at its start or end.
    assert min(firsts) < 1.0 and max(firsts) > 4.0
    assert all(4.5 <= d <= 5.5 for d in laters) and len({round(d, 6) for d in laters}) > 100
