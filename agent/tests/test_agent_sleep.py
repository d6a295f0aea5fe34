"""The agent puts engines to sleep and wakes them (sleep_shard, wake_shard), against the mock engine as a real
subprocess: acks, shard_status states and timings, refusals, and the races with drains and stops."""

import asyncio
import json
import time

import httpx

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

CHAT = {"model": "mock-small", "messages": [{"role": "user", "content": "are you awake"}]}


async def start_sleepable(cp: ControlPlane, shard_id: int, *args: str, engine: str = "mock") -> int:
    """Start a mock engine able to sleep; return its port once it is ready."""
    return await start_ready(cp, shard_id, *args, sleep_mode=True, engine=engine)


async def ack(cp: ControlPlane, cid: str) -> dict:
    message = await cp.next(protocol.ACK)
    assert message["cid"] == cid, message
    return message


async def engine_get(port: int, path: str) -> dict:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        return (await client.get(f"http://127.0.0.1:{port}{path}")).json()


async def chat(port: int) -> dict:
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        return (await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT)).json()


def test_sleep_then_wake_reports_each_state_with_its_time_and_a_held_request_is_served_after_the_wake():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = await start_sleepable(cp, 1, "--wake-seconds", "0.4")
            await cp.send(command(protocol.SLEEP_SHARD, 1, cid="s1", shard_id=1, level=1, timeout_seconds=5))
            assert (await ack(cp, "s1"))["refused"] is False
            slept = await cp.next(protocol.SHARD_STATUS)
            assert (slept["shard_id"], slept["state"], slept["sleep_level"]) == (1, "sleeping", 1)
            assert slept["message"] == "drained: no running requests"
            assert 0 <= slept["seconds"] < 3
            assert await engine_get(port, "/is_sleeping") == {"is_sleeping": True}
            beat = await fresh_heartbeat(cp)
            # Asleep, the engine's own gauges do not count what it holds: its load is not known.
            assert beat["shards"] == [{"shard_id": 1, "state": "sleeping", "running": None}]
            assert agent.running_shards()[0]["state"] == "sleeping"

            held = asyncio.create_task(chat(port))
            await asyncio.sleep(0.3)
            assert not held.done()
            await cp.send(command(protocol.WAKE_SHARD, 1, cid="w1", shard_id=1))
            assert (await ack(cp, "w1"))["refused"] is False
            woke = await cp.next(protocol.SHARD_STATUS)
            assert (woke["shard_id"], woke["state"], woke["port"]) == (1, "ready", port)
            assert 0.4 <= woke["seconds"] < 3  # the engine's --wake-seconds, and the calls around it
            assert (await held)["choices"][0]["finish_reason"] == "stop"
            assert (await fresh_heartbeat(cp))["shards"] == [{"shard_id": 1, "state": "ready", "running": 0}]
            await agent.shutdown()
            await task

    run(scenario())


def test_a_level_2_wake_reloads_the_weights_before_it_reports_ready():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = await start_sleepable(cp, 2)
            await cp.send(command(protocol.SLEEP_SHARD, 1, cid="s2", shard_id=2, level=2))
            slept = await cp.next(protocol.SHARD_STATUS)
            assert (slept["state"], slept["sleep_level"]) == ("sleeping", 2)
            # The same level again (a copy re-sent) is answered again; another level is refused.
            await cp.send(command(protocol.SLEEP_SHARD, 1, cid="s2", shard_id=2, level=2))
            assert (await ack(cp, "s2"))["refused"] is False
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "sleeping"
            await cp.send(command(protocol.SLEEP_SHARD, 1, cid="s3", shard_id=2, level=1))
            refused = await ack(cp, "s3")
            assert refused["refused"] and refused["message"] == "shard 2 already sleeps at level 2; wake it first"
            held = asyncio.create_task(chat(port))
            await asyncio.sleep(0.3)
            assert not held.done()
            await cp.send(command(protocol.WAKE_SHARD, 1, cid="w2", shard_id=2))
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "ready"
            # The request queued during the sleep ran on the reloaded weights: the mock, as vLLM, runs what it
            # holds once fully awake, and answers one run before the reload with NO_WEIGHTS words.
            assert (await held)["choices"][0]["message"]["content"] == "mock reply from mock-small: are you awake"
            async with asyncio.timeout(2):
                assert (await chat(port))["choices"][0]["finish_reason"] == "stop"
            await agent.shutdown()
            await task

    run(scenario())


def test_sleep_waits_for_the_stream_in_flight_and_does_not_cut_it():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url], drain_poll_seconds=0.1)
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = await start_sleepable(cp, 3, "--token-delay-ms", "100")
            answering = asyncio.Event()
            stream = asyncio.create_task(open_stream(port, answering))
            await answering.wait()
            await cp.send(command(protocol.SLEEP_SHARD, 1, cid="s4", shard_id=3, timeout_seconds=30))
            beat = await fresh_heartbeat(cp)
            assert beat["shards"][0]["state"] == "falling_asleep" and beat["shards"][0]["running"] >= 1
            lines = await stream
            ended = time.monotonic()
            # Answered to its end (a sleep in flight would have ended it with finish reason "abort").
            assert lines[-1] == "data: [DONE]" and '"finish_reason": "stop"' in lines[-2]
            slept = await cp.next(protocol.SHARD_STATUS)
            assert (slept["state"], slept["message"]) == ("sleeping", "drained: no running requests")
            assert time.monotonic() - ended < 2.0
            await agent.shutdown()
            await task

    run(scenario())


def test_a_sleep_past_its_timeout_cuts_what_still_runs_and_says_so():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url], drain_poll_seconds=0.1)
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = await start_sleepable(cp, 10, "--token-delay-ms", "1000")  # a 16 s answer
            answering = asyncio.Event()
            stream = asyncio.create_task(open_stream(port, answering))
            await answering.wait()
            started = time.monotonic()
            await cp.send(command(protocol.SLEEP_SHARD, 1, shard_id=10, timeout_seconds=0.5))
            slept = await cp.next(protocol.SHARD_STATUS, timeout=8)
            assert (slept["state"], slept["message"]) == ("sleeping", "drain timed out after 0.5 s with 1 running")
            assert 0.5 <= slept["seconds"] < 4 and time.monotonic() - started < 5
            # The engine ended it (vLLM's mode abort), instead of the sleep waiting 16 s for it.
            lines = await stream
            assert '"finish_reason": "abort"' in lines[-2]
            await agent.shutdown()
            await task

    run(scenario())


def test_refusals_name_why_llama_cpp_and_shards_started_without_sleep_mode_cannot_sleep(tmp_path):
    async def scenario():
        async with ControlPlane() as cp:
            # A llama.cpp shard that is only a stand-in: a sleep is refused before any engine is asked.
            server = tmp_path / "llama-server"
            server.write_text("#!/bin/sh\nexec sleep 30\n")
            server.chmod(0o755)
            agent = make_agent([cp.url], llama_server=str(server))
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            await cp.send(start_command(4, free_port(), engine="llamacpp", source="/m.gguf", sleep_mode=True))
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "starting"
            await cp.send(command(protocol.SLEEP_SHARD, 1, cid="l1", shard_id=4))
            refused = await ack(cp, "l1")
            assert refused["refused"] and refused["message"] == "llama.cpp has no sleep mode; stop it instead"

            await cp.send(start_command(5, free_port()))
            assert [(await cp.next(protocol.SHARD_STATUS))["state"] for _ in "ab"] == ["starting", "ready"]
            await cp.send(command(protocol.SLEEP_SHARD, 1, cid="m1", shard_id=5))
            refused = await ack(cp, "m1")
            assert refused["message"] == "shard was started without sleep_mode, so its mock engine cannot sleep"
            await cp.send(command(protocol.WAKE_SHARD, 1, cid="m2", shard_id=55))
            assert (await ack(cp, "m2"))["message"] == "shard 55 is not running on this node"
            # Fenced like every command: an older leader's sleep is refused, however sound.
            await cp.send(command(protocol.STOP_SHARD, 3, shard_id=99))
            await cp.send(command(protocol.SLEEP_SHARD, 2, cid="old", shard_id=5))
            assert (await ack(cp, "old"))["message"] == "epoch 2 is older than epoch 3 already seen"
            await agent.shutdown()
            await task

    run(scenario())


def test_a_wake_for_a_shard_going_to_sleep_is_refused_and_a_sleep_for_one_waking_too():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url], drain_poll_seconds=0.1)
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = await start_sleepable(cp, 6, "--token-delay-ms", "200", "--wake-seconds", "1")
            answering = asyncio.Event()
            stream = asyncio.create_task(open_stream(port, answering))
            await answering.wait()
            await cp.send(command(protocol.SLEEP_SHARD, 1, cid="s6", shard_id=6, timeout_seconds=30))
            await ack(cp, "s6")
            await cp.send(command(protocol.WAKE_SHARD, 1, cid="w6", shard_id=6))
            refused = await ack(cp, "w6")
            assert refused["message"] == "shard 6 is going to sleep; wake it once it reports sleeping"
            await stream
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "sleeping"
            await cp.send(command(protocol.WAKE_SHARD, 1, cid="w7", shard_id=6))
            await ack(cp, "w7")
            await cp.send(command(protocol.SLEEP_SHARD, 1, cid="s7", shard_id=6))
            assert (await ack(cp, "s7"))["message"] == "shard 6 is waking; it can sleep once ready"
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "ready"
            await agent.shutdown()
            await task

    run(scenario())


def test_a_stop_during_a_sleep_wins_and_only_the_stop_is_reported():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url], drain_poll_seconds=0.1)
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = await start_sleepable(cp, 7, "--token-delay-ms", "1000")
            pid = agent.engine_pid(7)
            answering = asyncio.Event()
            stream = asyncio.create_task(open_stream(port, answering))
            await answering.wait()
            await cp.send(command(protocol.SLEEP_SHARD, 1, shard_id=7, timeout_seconds=60))
            await cp.next(protocol.HEARTBEAT)
            await cp.send(command(protocol.STOP_SHARD, 1, shard_id=7))
            stopped = await cp.next(protocol.SHARD_STATUS, timeout=8)
            assert (stopped["state"], stopped["message"][:24]) == ("stopped", "engine exited with code ")
            assert process_gone(pid)
            await cp.next(protocol.HEARTBEAT)
            await cp.next(protocol.HEARTBEAT)
            queued = [cp.messages.get_nowait() for _ in range(cp.messages.qsize())]
            assert [m for m in queued if m["type"] == protocol.SHARD_STATUS] == []
            stream.cancel()
            await agent.shutdown()
            await task

    run(scenario())


def test_a_drain_of_a_sleeping_shard_stops_it_at_once_saying_it_was_asleep_and_a_resent_start_is_answered():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = await start_sleepable(cp, 8)
            pid = agent.engine_pid(8)
            await cp.send(command(protocol.SLEEP_SHARD, 1, shard_id=8))
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "sleeping"
            # A start re-sent meanwhile is answered with what the shard is now, not started twice.
            await cp.send(start_command(8, port, sleep_mode=True))
            again = await cp.next(protocol.SHARD_STATUS)
            assert (again["state"], again["sleep_level"], agent.engine_pid(8)) == ("sleeping", 1, pid)
            await cp.send(command(protocol.DRAIN_SHARD, 1, shard_id=8, timeout_seconds=60))
            stopped = await cp.next(protocol.SHARD_STATUS)
            assert stopped["state"] == "stopped"
            assert stopped["message"].startswith("stopped at once: the engine was asleep; engine exited")
            assert process_gone(pid)
            await agent.shutdown()
            await task

    run(scenario())


def test_a_wake_that_fails_names_the_call_and_the_engine_is_stopped(tmp_path):
    hold = tmp_path / "hold"

    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            port = free_port()
            await cp.send(start_command(9, port, sleep_mode=True, env={"LLMGW_MOCK_HOLD_FILE": str(hold)}))
            assert [(await cp.next(protocol.SHARD_STATUS))["state"] for _ in "ab"] == ["starting", "ready"]
            pid = agent.engine_pid(9)
            await cp.send(command(protocol.SLEEP_SHARD, 1, shard_id=9))
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "sleeping"
            hold.write_text("")  # from now on the engine's /health answers 503: it wakes but is not healthy
            await cp.send(command(protocol.WAKE_SHARD, 1, cid="f1", shard_id=9))
            assert (await ack(cp, "f1"))["refused"] is False
            failed = await cp.next(protocol.SHARD_STATUS)
            assert failed["state"] == "failed"
            assert failed["message"].startswith("wake from level 1 failed: GET /health answered HTTP 503: held back")
            assert failed["message"].endswith("; the engine was stopped")
            assert process_gone(pid) and agent.running_shards() == []
            await agent.shutdown()
            await task

    run(scenario())


def test_command_helper_builds_sleeps_and_wakes_the_agent_gate_accepts():
    built = command(protocol.SLEEP_SHARD, 3, shard_id=9, level=2, timeout_seconds=2.5)
    assert protocol.decode_command(json.dumps(built)) == protocol.SleepShard(
        epoch=3, shard_id=9, level=2, timeout_seconds=2.5
    )
    assert protocol.decode_command(json.dumps(command(protocol.WAKE_SHARD, 3, shard_id=9))) == protocol.WakeShard(
        epoch=3, shard_id=9
    )
