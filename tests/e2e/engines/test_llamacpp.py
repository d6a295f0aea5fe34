"""End to end with a real engine: llama.cpp's `llama-server`, built from source, behind the whole stack.

A tiny llama model with random weights (tests/tiny_gguf.py) is the catalog's
only model, served by the llama.cpp engine. `up --demo --catalog FILE` runs
with `LLMGW_LLAMA_SERVER` pointing at the binary `manage.py build_llama_server`
cached; the router activates the model on a simulated node, whose agent starts
`llama-server` from agent/engines/launch.py's argv. Through the router, with the
official `openai` SDK: the model list, a chat completion and a stream, each
answered by llama.cpp itself (its build in `system_fingerprint`). The router's
own /metrics then shows the load it parsed from llama.cpp's /metrics, and a
graceful stop takes the engine with it.

Random weights say nothing, so the answers are checked for shape: a choice,
the length asked for (the model never picks end-of-text, see tiny_gguf), and
usage counted by the engine.

The binary comes from `LLMGW_LLAMA_SERVER` or the build cache (`make
llama-server`). Without it the test fails, except on a machine that cannot
build it (no cmake or compiler), where it is skipped saying so.
"""

import os
import shutil
import signal
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from conftest import wait_until
from runner.llama_server import build_place, missing_build_tools
from tests.e2e.demo_stack import API_KEY, ctl_status, demo_stack, engine_pids
from tests.tiny_gguf import write_tiny_llama

pytestmark = [pytest.mark.e2e, pytest.mark.real_engine]

MODEL = "tiny-llama"
MAX_TOKENS = 8


def llama_server_binary() -> str:
    """The binary to run: LLMGW_LLAMA_SERVER if set, else the cached build; fail (or skip) as the docstring says."""
    configured = os.environ.get("LLMGW_LLAMA_SERVER", "").strip()
    if configured:
        found = shutil.which(configured)
        if found is None:
            pytest.fail(f"LLMGW_LLAMA_SERVER={configured!r} is not an executable")
        return str(Path(found).resolve())
    binary = build_place().binary
    if binary.is_file():
        return str(binary)
    missing = missing_build_tools()
    if missing:
        pytest.skip(f"llama-server cannot be built here: {', '.join(missing)} not found (apt-get install cmake g++)")
    pytest.fail(f"llama-server is not built ({binary} is missing): run `make llama-server` first")


def catalog_for(model_file: Path) -> str:
    # One thread and a small context: the model is tiny and the machine is shared.
    return f"""
models:
  - name: {MODEL}
    source: {model_file}
    profiles:
      - {{engine: llamacpp, gpu_class: L40S-48GB, gpus_per_node: 1, idle_timeout_seconds: 0,
         engine_args: ["--ctx-size", "1024", "--parallel", "2", "--threads", "1"]}}
"""


@pytest.fixture
def llama_stack(tmp_path):
    binary = llama_server_binary()
    model_file = write_tiny_llama(tmp_path / "tiny-llama.gguf")
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(catalog_for(model_file))
    env = {"LLMGW_LLAMA_SERVER": binary, "LLMGW_ENGINE_POLL_SECONDS": "0.2", "LLMGW_HEARTBEAT_SECONDS": "1"}
    with demo_stack(tmp_path, "--catalog", str(catalog), env=env) as stack:
        yield stack | {"binary": binary}


def test_llama_server_answers_through_the_router_and_its_metrics_are_parsed(llama_stack):
    stack = llama_stack
    client = OpenAI(base_url=stack["router"] + "/v1", api_key=API_KEY, timeout=60, max_retries=0)

    assert MODEL in [m.id for m in client.models.list().data]

    # The first request activates the model: the agent starts llama-server and the router waits for it.
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=MAX_TOKENS, temperature=0
    )
    assert engine_pids(stack["var"], stack["binary"].encode()), "llama-server should be the engine answering"
    assert reply.system_fingerprint and reply.system_fingerprint.startswith("b"), "llama.cpp names its build here"
    assert len(reply.choices) == 1
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.completion_tokens == MAX_TOKENS
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + MAX_TOKENS

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "stream please"}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c for c in chunks if c.choices]
    assert len(deltas) >= 2, "a stream comes in several chunks"
    assert deltas[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS

    replicas = [r for r in ctl_status(stack["env"])["replica_list"] if r["model"] == MODEL]
    assert len(replicas) == 1 and replicas[0]["state"] == "ready"
    replica = replicas[0]["id"]

    # The router read llama.cpp's own gauges: its queue (`llamacpp:requests_deferred`) is a sample for this
    # replica. llama.cpp's server no longer exposes KV cache usage, so that figure stays unknown (no sample).
    waiting = f'llmgw_router_engine_waiting_requests{{model="{MODEL}",replica="{replica}"}} 0.0'

    def router_metrics():
        return httpx.get(stack["router"] + "/metrics", timeout=5).text

    def parsed():
        text = router_metrics()
        return text if waiting in text else None

    text = wait_until(parsed, 10, 0.2, describe=router_metrics)
    assert f'llmgw_router_engine_kv_cache_usage_ratio{{model="{MODEL}"' not in text

    # A graceful stop of `up` stops llama-server too.
    stack["proc"].send_signal(signal.SIGINT)
    assert stack["proc"].wait(30) == 0, stack["log"].read_text()
    wait_until(lambda: not engine_pids(stack["var"], stack["binary"].encode()), 10, 0.3)
