"""The agent loads and unloads LoRA adapters (load_adapter, unload_adapter) in the mock engine as a real
subprocess: acks, adapter_status with its timing, heartbeats' adapters, refusals, and one shard's commands run
in the order they came."""

import asyncio

import httpx

from agent.tests.stand_ins import ControlPlane, command, fresh_heartbeat, make_agent, run, start_command, start_ready
from conftest import free_port
from nodewire import adapter_messages, parts, protocol


def slots(count: int) -> parts.AdapterSlots:
    return parts.AdapterSlots(slots=count)


def load(cid: str, shard_id: int, name: str, source: str = "org/adapter", epoch: int = 1) -> dict:
    return command(adapter_messages.LOAD_ADAPTER, epoch, cid=cid, shard_id=shard_id, name=name, source=source)


def unload(cid: str, shard_id: int, name: str, epoch: int = 1) -> dict:
    return command(adapter_messages.UNLOAD_ADAPTER, epoch, cid=cid, shard_id=shard_id, name=name)


async def ack(cp: ControlPlane, cid: str) -> dict:
    message = await cp.next(protocol.ACK)
    assert message["cid"] == cid, message
    return message


async def status(cp: ControlPlane) -> dict:
    return await cp.next(adapter_messages.ADAPTER_STATUS)


async def agent_running(cp: ControlPlane) -> tuple:
    agent = make_agent([cp.url])
    task = asyncio.create_task(agent.run())
    await cp.next(protocol.HELLO)
    return agent, task


def test_load_is_acknowledged_reported_with_its_time_listed_in_heartbeats_served_and_unloaded():
    async def scenario():
        async with ControlPlane() as cp:
            agent, task = await agent_running(cp)
            port = await start_ready(cp, 1, "--lora-load-seconds", "0.3", adapters=slots(2))
            assert (await fresh_heartbeat(cp))["shards"][0]["adapters"] == []
            await cp.send(load("l1", 1, "sql"))
            assert (await ack(cp, "l1"))["refused"] is False
            loaded = await status(cp)
            assert (loaded["shard_id"], loaded["name"], loaded["state"], loaded["message"]) == (1, "sql", "loaded", "")
            assert 0.3 <= loaded["seconds"] < 3  # the engine's --lora-load-seconds, and the call around it
            assert (await fresh_heartbeat(cp))["shards"] == [
                {"shard_id": 1, "state": "ready", "running": 0, "adapters": ["sql"]}
            ]
            async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                body = {"model": "sql", "messages": [{"role": "user", "content": "hi"}]}
                reply = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
            assert reply.json()["model"] == "sql"

            # A copy re-sent: the engine holds it already, so it is loaded.
            await cp.send(load("l1", 1, "sql"))
            again = await status(cp)
            assert (again["state"], again["message"]) == ("loaded", "the engine held it already")
            await cp.send(unload("u1", 1, "sql"))
            assert (await ack(cp, "u1"))["refused"] is False
            unloaded = await status(cp)
            assert (unloaded["name"], unloaded["state"], unloaded["seconds"]) == ("sql", "unloaded", None)
            assert (await fresh_heartbeat(cp))["shards"][0]["adapters"] == []
            # Unloading what the engine does not hold reaches the goal too.
            await cp.send(unload("u2", 1, "sql"))
            gone = await status(cp)
            assert (gone["state"], gone["message"]) == ("unloaded", "the engine did not hold it")
            await agent.shutdown()
            await task

    run(scenario())


def test_loads_are_refused_for_a_shard_not_running_without_slots_not_ready_or_from_a_stale_leader():
    async def scenario():
        async with ControlPlane() as cp:
            agent, task = await agent_running(cp)
            await cp.send(load("l1", 9, "sql"))
            assert (await ack(cp, "l1")) | {"type": "ack"} == {
                "type": "ack", "v": 1, "cid": "l1", "refused": True, "message": "shard 9 is not running on this node"
            }  # fmt: skip
            await start_ready(cp, 1)
            assert "adapters" not in (await fresh_heartbeat(cp))["shards"][0]
            await cp.send(load("l2", 1, "sql"))
            refused = await ack(cp, "l2")
            assert refused["refused"]
            assert refused["message"] == "shard was started without adapter slots, so its mock engine takes none"

            # Still starting (its cold start holds /health back).
            await cp.send(start_command(2, free_port(), args=["--load-seconds", "5"], adapters=slots(1)))
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "starting"
            await cp.send(unload("u3", 2, "sql"))
            refused = await ack(cp, "u3")
            assert refused["message"] == "shard 2 is still starting; its adapters can change once it is ready"

            # Asleep.
            await start_ready(cp, 3, adapters=slots(1), sleep_mode=True)
            await cp.send(command(protocol.SLEEP_SHARD, 1, cid="s3", shard_id=3, level=1))
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "sleeping"
            await cp.send(load("l3", 3, "sql"))
            assert (await ack(cp, "l3"))["message"] == "shard 3 is asleep; wake it first"

            # A newer leader has spoken: the older one's load is refused, and nothing is loaded.
            await cp.send(command(protocol.WAKE_SHARD, 2, cid="w3", shard_id=3))
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "ready"
            await cp.send(load("l4", 3, "sql", epoch=1))
            stale = await ack(cp, "l4")
            assert stale["refused"] and stale["message"] == "epoch 1 is older than epoch 2 already seen"
            beat = await fresh_heartbeat(cp)
            assert {s["shard_id"]: s.get("adapters") for s in beat["shards"]} == {1: None, 2: [], 3: []}
            await agent.shutdown()
            await task

    run(scenario(), timeout=30)


def test_a_load_on_a_full_engine_fails_with_the_engines_words_and_a_missing_folder_too(tmp_path):
    async def scenario():
        async with ControlPlane() as cp:
            agent, task = await agent_running(cp)
            await start_ready(cp, 1, adapters=slots(1))
            await cp.send(load("l1", 1, "a"))
            assert (await status(cp))["state"] == "loaded"
            await cp.send(load("l2", 1, "b"))
            assert (await ack(cp, "l2"))["refused"] is False
            failed = await status(cp)
            assert (failed["name"], failed["state"], failed["seconds"]) == ("b", "failed", None)
            assert failed["message"] == (
                "POST /v1/load_lora_adapter answered HTTP 500: Cannot load LoRA adapter 'b': all 1 --max-loras "
                "slots hold adapters (a); unload one first"
            )
            await cp.send(unload("u1", 1, "a"))
            assert (await status(cp))["state"] == "unloaded"
            await cp.send(load("l3", 1, "c", str(tmp_path / "nowhere")))
            missing = await status(cp)
            assert missing["state"] == "failed"
            assert missing["message"].endswith(
                f"HTTP 404: Loading lora c failed: No adapter found for {tmp_path}/nowhere"
            )
            assert (await fresh_heartbeat(cp))["shards"][0]["adapters"] == []
            await agent.shutdown()
            await task

    run(scenario())


def test_one_shards_commands_run_in_order_so_an_unload_frees_the_slot_for_the_load_after_it():
    async def scenario():
        async with ControlPlane() as cp:
            agent, task = await agent_running(cp)
            # Loads take 0.5 s: run side by side, the unload would find nothing to unload yet and the second
            # load would find the one slot taken by the first.
            await start_ready(cp, 1, "--lora-load-seconds", "0.5", adapters=slots(1))
            await start_ready(cp, 2, "--lora-load-seconds", "0.5", adapters=slots(1))
            started = asyncio.get_running_loop().time()
            for message in (load("l1", 1, "a"), unload("u1", 1, "a"), load("l2", 1, "b"), load("l3", 2, "c")):
                await cp.send(message)
            reports = [await status(cp) for _ in range(4)]
            took = asyncio.get_running_loop().time() - started
            assert [(r["name"], r["state"]) for r in reports if r["shard_id"] == 1] == [
                ("a", "loaded"), ("a", "unloaded"), ("b", "loaded")
            ]  # fmt: skip
            assert [(r["name"], r["state"]) for r in reports if r["shard_id"] == 2] == [("c", "loaded")]
            # Shard 2's load ran beside shard 1's: it did not wait behind them.
            assert reports.index(next(r for r in reports if r["shard_id"] == 2)) < 3
            assert 1.0 <= took < 4
            beat = await fresh_heartbeat(cp)
            assert {s["shard_id"]: s["adapters"] for s in beat["shards"]} == {1: ["b"], 2: ["c"]}
            await agent.shutdown()
            await task

    run(scenario(), timeout=30)


def test_a_stopped_engines_adapters_are_forgotten_and_a_restarted_one_holds_none():
    async def scenario():
        async with ControlPlane() as cp:
            agent, task = await agent_running(cp)
            port = await start_ready(cp, 1, adapters=slots(2))
            await cp.send(load("l1", 1, "a"))
            assert (await status(cp))["state"] == "loaded"
            await cp.send(command(protocol.STOP_SHARD, 1, shard_id=1))
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "stopped"
            await cp.send(load("l2", 1, "a"))
            assert (await ack(cp, "l2"))["message"] == "shard 1 is not running on this node"
            await cp.send(start_command(1, port, adapters=slots(2)))
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "starting"
            assert (await cp.next(protocol.SHARD_STATUS))["state"] == "ready"
            assert (await fresh_heartbeat(cp))["shards"][0]["adapters"] == []
            await agent.shutdown()
            await task

    run(scenario())
