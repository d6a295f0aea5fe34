"""What makes each engine able to sleep (start_shard's sleep_mode): argv, environment and sleep dialect."""

from agent.engines.launch import build_launch
from agent.gpus.discovery import parse_fake_gpus
from agent.options import AgentOptions
from agent.starting import launch_for
from agent.tests.engines.test_launch import BASE
from nodewire import protocol


def launch(engine, **overrides):
    fields = {**BASE, "gpu_indices": [0, 1], "rank": 0, "node_count": 1, **overrides}
    return build_launch(engine, python="/opt/py/bin/python", **fields)


def test_vllm_on_real_gpus_gets_the_sleep_flag_and_its_development_routes():
    result = launch("vllm", sleep_mode=True, args=["--max-model-len", "8192"])
    assert result.argv[-3:] == ["--max-model-len", "8192", "--enable-sleep-mode"]
    assert result.env == {"CUDA_VISIBLE_DEVICES": "0,1", "VLLM_SERVER_DEV_MODE": "1"}
    assert (result.sleep, result.no_sleep) == ("vllm", "")


def test_vllm_on_simulated_gpus_gets_the_routes_but_not_the_flag_its_cpu_build_refuses():
    result = launch("vllm", sleep_mode=True, gpus_simulated=True)
    assert "--enable-sleep-mode" not in result.argv
    assert result.env["VLLM_SERVER_DEV_MODE"] == "1" and result.sleep == "vllm"


def test_without_sleep_mode_nothing_changes_and_the_launch_says_why_it_cannot_sleep():
    plain, asked = launch("vllm"), launch("vllm", sleep_mode=False)
    assert plain == asked and "--enable-sleep-mode" not in plain.argv and "VLLM_SERVER_DEV_MODE" not in plain.env
    assert plain.sleep is None
    assert plain.no_sleep == "shard was started without sleep_mode, so its vllm engine cannot sleep"


def test_sglang_gets_its_memory_saver_with_the_weights_kept_in_host_memory():
    result = launch("sglang", sleep_mode=True)
    assert result.argv[-2:] == ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    assert "VLLM_SERVER_DEV_MODE" not in result.env and result.sleep == "sglang"


def test_llama_cpp_cannot_sleep_whatever_it_is_asked():
    result = launch("llamacpp", gpu_indices=[0], source="/m.gguf", sleep_mode=True)
    assert result.argv == launch("llamacpp", gpu_indices=[0], source="/m.gguf").argv
    assert (result.sleep, result.no_sleep) == (None, "llama.cpp has no sleep mode; stop it instead")


def test_ranks_above_0_of_a_real_engine_sleep_with_their_head_and_the_mock_sleeps_itself():
    two = {"node_count": 2, "head_address": "10.0.0.1", "rendezvous_port": 20001, "sleep_mode": True}
    follower = launch("vllm", rank=1, vllm_command=("vllm", "serve"), **two)
    assert follower.sleep == "follower" and "--enable-sleep-mode" in follower.argv
    assert launch("sglang", rank=1, **two).sleep == "follower"
    mock = launch("mock", rank=1, **two)
    assert mock.sleep == "vllm" and mock.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "--enable-sleep-mode" not in mock.argv


def test_the_agent_tells_fake_gpus_from_real_ones_when_it_builds_a_vllm_start():
    fake = parse_fake_gpus("2xH100-80GB", "n1")
    real = [type(g)(g.index, g.uuid, g.gpu_class, g.memory_mb) for g in fake]
    assert all(g.simulated for g in fake) and not any(g.simulated for g in real)
    start = protocol.StartShard(
        epoch=1, shard_id=1, engine="vllm", model="m", source="m", gpu_indices=[1], port=20000, sleep_mode=True
    )

    def argv(gpus):
        options = AgentOptions(["ws://127.0.0.1:9/agent/ws"], "n1", "t", gpus, "127.0.0.1", vllm_command=["vllm"])
        return launch_for(start, options, gpus).argv

    assert "--enable-sleep-mode" in argv(real)
    assert "--enable-sleep-mode" not in argv(fake)
