"""LoRA switched on for a shard that takes adapters (start_shard's `adapters`): argv, environment and adapter
dialect per engine, the protocol field, and the mock engine's flags."""

import json

import pytest

from agent.engines.launch import build_launch
from agent.gpus.discovery import parse_fake_gpus
from agent.options import AgentOptions
from agent.starting import launch_for
from agent.tests.engines.test_launch import BASE
from mockengine.lora import MockLoRA
from mockengine.server import create_app, parse_args
from mockengine.text import ENGINE
from nodewire import parts, protocol

START = {"type": "start_shard", "v": 1, "epoch": 1, "shard_id": 1, "engine": "vllm", "model": "m", "source": "m",
         "gpu_indices": [0], "port": 20000}  # fmt: skip


def launch(engine, **overrides):
    fields = {**BASE, "gpu_indices": [0, 1], "rank": 0, "node_count": 1, **overrides}
    return build_launch(engine, python="/opt/py/bin/python", **fields)


def test_vllm_gets_lora_its_slots_and_rank_and_its_runtime_update_switch():
    result = launch("vllm", adapter_slots=8, max_adapter_rank=64, args=["--max-model-len", "8192"])
    flags = ["--max-model-len", "8192", "--enable-lora", "--max-loras", "8", "--max-lora-rank", "64"]
    assert result.argv[-len(flags) :] == flags
    assert result.env == {"CUDA_VISIBLE_DEVICES": "0,1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    # Without a rank, vLLM's own default applies.
    assert launch("vllm", adapter_slots=2).argv[-3:] == ["--enable-lora", "--max-loras", "2"]


def test_sglang_gets_its_batch_slots_with_every_module_loadable():
    result = launch("sglang", adapter_slots=4, max_adapter_rank=16)
    flags = ["--enable-lora", "--max-loras-per-batch", "4", "--lora-target-modules", "all", "--max-lora-rank", "16"]
    assert result.argv[-len(flags) :] == flags
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in result.env


def test_the_mock_takes_vllms_flags_and_environment_and_llama_cpp_is_refused():
    mock = launch("mock", adapter_slots=3)
    assert mock.argv[-3:] == ["--enable-lora", "--max-loras", "3"]
    assert mock.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    with pytest.raises(ValueError, match="llama.cpp cannot load adapters at run time"):
        launch("llamacpp", gpu_indices=[0], source="/m.gguf", adapter_slots=2)
    with pytest.raises(ValueError, match="adapter slots must be a positive integer, got 0"):
        launch("vllm", adapter_slots=0)
    with pytest.raises(ValueError, match="a max adapter rank needs adapter slots"):
        launch("vllm", max_adapter_rank=16)


def test_without_adapters_a_launch_is_as_before_and_sleep_and_lora_combine():
    assert launch("vllm") == launch("vllm", adapter_slots=None)
    both = launch("vllm", adapter_slots=2, sleep_mode=True)
    assert both.argv[-4:] == ["--enable-lora", "--max-loras", "2", "--enable-sleep-mode"]
    assert both.env["VLLM_SERVER_DEV_MODE"] == "1" and both.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"


def test_every_rank_of_a_replica_gets_the_same_lora_flags():
    two = {"node_count": 2, "head_address": "10.0.0.1", "rendezvous_port": 20001, "adapter_slots": 4}
    follower = launch("vllm", rank=1, vllm_command=("vllm", "serve"), **two)
    assert follower.argv[follower.argv.index("--enable-lora") :][:3] == ["--enable-lora", "--max-loras", "4"]
    assert "--max-loras-per-batch" in launch("sglang", rank=1, **two).argv


def test_start_shard_adapters_are_optional_left_out_unless_set_and_checked():
    plain = protocol.decode_command(json.dumps(START))
    assert plain.adapters is protocol.UNSET and "adapters" not in protocol.to_builtins(plain)
    asked = protocol.decode_command(json.dumps({**START, "adapters": {"slots": 8, "max_rank": 32}}))
    assert asked.adapters == parts.AdapterSlots(slots=8, max_rank=32)
    assert protocol.to_builtins(asked)["adapters"] == {"slots": 8, "max_rank": 32}
    with pytest.raises(protocol.ProtocolError, match=r"Expected `int` >= 1 - at `\$.adapters.slots`"):
        protocol.decode_command(json.dumps({**START, "adapters": {"slots": 0}}))


def test_the_agent_turns_a_start_with_adapters_into_the_engines_flags():
    gpus = parse_fake_gpus("1xH100-80GB", "n1")
    options = AgentOptions(["ws://127.0.0.1:9/agent/ws"], "n1", "t", gpus, "127.0.0.1", vllm_command=["vllm"])
    start = protocol.decode_command(json.dumps({**START, "adapters": {"slots": 8}}))
    result = launch_for(start, options, gpus)
    assert result.argv[-3:] == ["--enable-lora", "--max-loras", "8"]
    assert result.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    assert "--enable-lora" not in launch_for(protocol.decode_command(json.dumps(START)), options, gpus).argv


def test_each_launch_says_how_its_engine_loads_adapters_or_why_it_cannot():
    assert (launch("vllm", adapter_slots=2).adapters, launch("sglang", adapter_slots=2).adapters) == ("vllm", "sglang")
    assert launch("mock", adapter_slots=2).adapters == "vllm"
    two = {"node_count": 2, "head_address": "10.0.0.1", "rendezvous_port": 20001, "adapter_slots": 4}
    # A real engine's ranks above 0 hold what their head loads; the mock serves every rank itself.
    assert launch("vllm", rank=1, vllm_command=("vllm", "serve"), **two).adapters == "follower"
    assert launch("sglang", rank=1, **two).adapters == "follower"
    assert launch("mock", rank=1, **two).adapters == "vllm"
    plain = launch("vllm")
    assert plain.adapters is None
    assert plain.no_adapters == "shard was started without adapter slots, so its vllm engine takes none"
    llama = launch("llamacpp", gpu_indices=[0], source="/m.gguf")
    assert (llama.adapters, llama.no_adapters) == (None, "llama.cpp cannot load adapters at run time")


def test_the_mock_engine_parses_vllms_lora_flags_and_its_load_time(capsys):
    args = parse_args(["--port", "20000", "--model", "m", "--enable-lora", "--max-loras", "8", "--max-lora-rank", "16"])
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.lora_load_seconds) == (True, 8, 16, 0.0)
    plain = parse_args(["--port", "20000", "--model", "m", "--lora-load-seconds", "1.5"])
    assert (plain.enable_lora, plain.max_loras, plain.lora_load_seconds) == (False, None, 1.5)
    # vLLM's defaults: one slot, rank 16.
    assert (MockLoRA(True).max_loras, MockLoRA(True).max_rank) == (1, 16)
    assert create_app("m", lora=MockLoRA(True, 8))[ENGINE].lora.max_loras == 8
    with pytest.raises(SystemExit):
        parse_args(["--port", "20000", "--model", "m", "--max-loras", "0"])
    assert "argument --max-loras: expected a positive integer, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--port", "20000", "--model", "m", "--lora-load-seconds", "soon"])
    assert "a time must be a number of seconds, got 'soon'" in capsys.readouterr().err
