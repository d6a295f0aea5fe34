"""The agent reports each engine's requests in flight and drains for real, against the mock engine as a real subprocess."""

import asyncio
import json
import stat
import time

from agent.tests.stand_ins import (
    ControlPlane,
    command,
    fresh_heartbeat,
    make_agent,
    open_stream,
    process_gone,
    run,
    start_command,
    start_ready,
)
from conftest import free_port
from nodewire import protocol


async def start_slow(cp: ControlPlane, shard_id: int, token_delay_ms: int) -> int:
    """Start a mock engine that takes `token_delay_ms` per token; return its port once it is ready."""
    return await start_ready(cp, shard_id, "--token-delay-ms", str(token_delay_ms))


async def heartbeat_running(cp: ControlPlane, shard_id: int) -> int | None:
    """The `running` that a fresh heartbeat reports for `shard_id`."""
    [shard] = [s for s in (await fresh_heartbeat(cp))["shards"] if s["shard_id"] == shard_id]
    return shard["running"]


def test_heartbeat_reports_zero_when_idle_and_the_stream_in_flight_while_it_runs():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = await start_slow(cp, shard_id=1, token_delay_ms=100)
            assert await heartbeat_running(cp, 1) == 0
            answering = asyncio.Event()
            stream = asyncio.create_task(open_stream(port, answering))
            await answering.wait()
            assert await heartbeat_running(cp, 1) >= 1
            assert (await stream)[-1] == "data: [DONE]"
            assert await heartbeat_running(cp, 1) == 0
            await agent.shutdown()
            await task

    run(scenario())


def test_drain_waits_for_the_stream_in_flight_then_stops_right_after_it_ends():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url], drain_poll_seconds=0.1)
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = await start_slow(cp, shard_id=2, token_delay_ms=100)
            pid = agent.engine_pid(2)
            answering = asyncio.Event()
            stream = asyncio.create_task(open_stream(port, answering))
            await answering.wait()
            await cp.send(command(protocol.DRAIN_SHARD, 1, shard_id=2, timeout_seconds=30))
            beat = await fresh_heartbeat(cp)
            assert [(s["shard_id"], s["state"]) for s in beat["shards"]] == [(2, "draining")]
            assert beat["shards"][0]["running"] >= 1

            lines = await stream
            ended = time.monotonic()
            # The stream was answered to its end, not cut by the drain.
            assert lines[-1] == "data: [DONE]" and len(lines) > 16
            stopped = await cp.next(protocol.SHARD_STATUS)
            assert (stopped["shard_id"], stopped["state"]) == (2, "stopped")
            assert stopped["message"].startswith("drained: no running requests; engine exited with code")
            assert time.monotonic() - ended < 2.0
            assert process_gone(pid) and agent.running_shards() == []
            await agent.shutdown()
            await task

    run(scenario())


def test_drain_timeout_stops_an_engine_that_is_still_busy():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url], drain_poll_seconds=0.1)
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = await start_slow(cp, shard_id=3, token_delay_ms=1000)  # a 16 s answer
            pid = agent.engine_pid(3)
            answering = asyncio.Event()
            stream = asyncio.create_task(open_stream(port, answering))
            await answering.wait()
            started = time.monotonic()
            await cp.send(command(protocol.DRAIN_SHARD, 1, shard_id=3, timeout_seconds=0.5))
            stopped = await cp.next(protocol.SHARD_STATUS, timeout=8)
            assert (stopped["shard_id"], stopped["state"]) == (3, "stopped")
            assert stopped["message"].startswith("drain timed out after 0.5 s with 1 running; engine exited")
            assert 0.5 <= time.monotonic() - started < 6
            assert process_gone(pid)
            stream.cancel()
            await agent.shutdown()
            await task

    run(scenario())


def test_stop_during_a_drain_stops_at_once_and_a_repeated_drain_changes_nothing():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url], drain_poll_seconds=0.1)
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = await start_slow(cp, shard_id=4, token_delay_ms=1000)
            pid = agent.engine_pid(4)
            answering = asyncio.Event()
            stream = asyncio.create_task(open_stream(port, answering))
            await answering.wait()
            await cp.send(command(protocol.DRAIN_SHARD, 1, shard_id=4, timeout_seconds=60))
            await cp.send(command(protocol.DRAIN_SHARD, 1, shard_id=4, timeout_seconds=60))
            await cp.next(protocol.HEARTBEAT)
            assert not process_gone(pid)
            started = time.monotonic()
            await cp.send(command(protocol.STOP_SHARD, 1, shard_id=4))
            stopped = await cp.next(protocol.SHARD_STATUS, timeout=8)
            assert (stopped["shard_id"], stopped["state"]) == (4, "stopped")
            assert stopped["message"].startswith("drain cut short by a stop; engine exited")
            assert time.monotonic() - started < 5
            assert process_gone(pid)
            # One stop, one report: the second drain did not start a second wait.
            await cp.next(protocol.HEARTBEAT)
            await cp.next(protocol.HEARTBEAT)
            queued = [cp.messages.get_nowait() for _ in range(cp.messages.qsize())]
            assert [m for m in queued if m["type"] == protocol.SHARD_STATUS] == []
            stream.cancel()
            await agent.shutdown()
            await task

    run(scenario())


def test_shutdown_ends_a_drain_and_stops_the_engine():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = await start_slow(cp, shard_id=5, token_delay_ms=1000)
            pid = agent.engine_pid(5)
            answering = asyncio.Event()
            stream = asyncio.create_task(open_stream(port, answering))
            await answering.wait()
            await cp.send(command(protocol.DRAIN_SHARD, 1, shard_id=5, timeout_seconds=60))
            await cp.next(protocol.HEARTBEAT)
            started = time.monotonic()
            await agent.shutdown()
            await task
            assert time.monotonic() - started < 6
            assert process_gone(pid)
            stream.cancel()

    run(scenario())


def test_an_engine_not_serving_yet_is_stopped_at_once_on_drain(tmp_path):
    # An "engine" that never answers its health check: the shard stays starting.
    never_ready = tmp_path / "never-ready"
    never_ready.write_text("#!/bin/sh\nexec sleep 30\n")
    never_ready.chmod(never_ready.stat().st_mode | stat.S_IXUSR)

    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url], engine_python=str(never_ready))
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            await cp.send(start_command(6, free_port()))
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "starting"
            pid = agent.engine_pid(6)
            await cp.send(command(protocol.DRAIN_SHARD, 1, shard_id=6, timeout_seconds=60))
            stopped = await cp.next(protocol.SHARD_STATUS)
            assert (stopped["shard_id"], stopped["state"]) == (6, "stopped")
            assert stopped["message"].startswith("stopped at once: the engine was not serving yet")
            assert process_gone(pid)
            # A drain for a shard the agent does not run is answered, so the control plane can let go.
            await cp.send(command(protocol.DRAIN_SHARD, 1, shard_id=66))
            gone = await cp.next(protocol.SHARD_STATUS)
            assert (gone["shard_id"], gone["message"]) == (66, "no engine was running for this shard")
            await agent.shutdown()
            await task

    run(scenario())


def test_command_helper_builds_drains_the_agent_gate_accepts():
    built = command(protocol.DRAIN_SHARD, 3, shard_id=9, timeout_seconds=2.5)
    assert protocol.decode_command(json.dumps(built)) == protocol.DrainShard(epoch=3, shard_id=9, timeout_seconds=2.5)
