"""A profile's engine env reaches the engine process (a real subprocess) and no secret value reaches the log."""

import asyncio
import logging
from pathlib import Path

from agent.tests.stand_ins import TOKEN, ControlPlane, make_agent, run, start_command
from conftest import free_port
from nodewire import protocol

SECRET = "hf_do_not_log_me_7731"
STAND_IN = "websockets.server"  # the stand-in control plane's own log, not the agent's


def agent_log(caplog) -> str:
    """Every line the agent's process would log at DEBUG: its own modules' and its libraries'."""
    return "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith(STAND_IN))


def process_environment(pid: int) -> dict[str, str]:
    """What the kernel says process `pid` was started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_the_engine_process_gets_the_profiles_env_and_the_log_masks_secrets(caplog):
    caplog.set_level(logging.DEBUG)
    # The secret last: a frame logged elided keeps its end (websockets shows a frame's start and end).
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "WITH_SPACE": "a b", "HF_TOKEN": SECRET}

    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            await cp.send(start_command(5, free_port(), env=env))
            ready = await cp.next(protocol.SHARD_STATUS)
            assert (ready["shard_id"], ready["state"]) == (5, "starting")
            seen = process_environment(agent.engine_pid(5))
            await agent.shutdown()
            await task
            return seen

    seen = run(scenario())
    assert {name: seen.get(name) for name in env} == env
    assert seen["CUDA_VISIBLE_DEVICES"] == "0,1"  # the agent's own variable stays the agent's
    started = [r.getMessage() for r in caplog.records if r.name == "agent.runtime" and "started" in r.getMessage()]
    assert len(started) == 1
    assert "VLLM_CPU_KVCACHE_SPACE=1 WITH_SPACE='a b' HF_TOKEN='***' CUDA_VISIBLE_DEVICES=0,1 " in started[0]
    assert "-m mockengine" in started[0]
    logged = agent_log(caplog)
    assert "shard 5" in logged
    # Not even the end of it, nor the node's own credential from the handshake.
    assert SECRET[-8:] not in logged and TOKEN not in logged


def test_a_start_with_a_bad_env_fails_naming_the_variable_and_starts_nothing(caplog):
    caplog.set_level(logging.DEBUG)

    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            start = start_command(6, free_port())
            start["env"] = {"HF_TOKEN": SECRET, "CUDA_VISIBLE_DEVICES": "7"}
            await cp.send(start)
            failed = await cp.next(protocol.SHARD_STATUS)
            running = agent.running_shards()
            await agent.shutdown()
            await task
            return failed, running

    failed, running = run(scenario())
    assert (failed["shard_id"], failed["state"]) == (6, "failed")
    assert "Variable CUDA_VISIBLE_DEVICES cannot be set on a profile" in failed["message"]
    assert running == []
    assert SECRET[-8:] not in agent_log(caplog) and SECRET not in failed["message"]


def run_mock_needing(gib: str, shard_id: int):
    """Start a mock told its true need on the stand-in agent's two 80 GB GPUs; (first, last) shard status."""

    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            await cp.send(start_command(shard_id, free_port(), args=["--memory-gib-per-gpu", gib]))
            first = await cp.next(protocol.SHARD_STATUS)
            last = await cp.next(protocol.SHARD_STATUS)
            seen = process_environment(agent.engine_pid(shard_id)) if last["state"] != "failed" else {}
            await agent.shutdown()
            await task
            return first, last, seen

    return run(scenario())


def test_a_mock_needing_more_than_its_gpus_fails_its_start_like_cuda_out_of_memory():
    first, failed, _ = run_mock_needing("75", 8)  # 80 GiB × 0.92 = 73.6 GiB usable
    assert (first["state"], failed["state"]) == ("starting", "failed")
    assert "engine exited with code 1" in failed["message"]
    last_line = failed["message"].splitlines()[-1]
    assert last_line.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.40 GiB.")
    assert "GPU 0 has a total capacity of 80.00 GiB, of which 73.60 GiB may be used" in last_line


def test_a_mock_whose_need_fits_starts_and_is_told_its_gpus_memory():
    first, ready, seen = run_mock_needing("73", 9)
    assert (first["state"], ready["state"]) == ("starting", "ready")
    assert seen["LLMGW_GPU_MEMORY_MIB"] == "81920,81920"
