"""End to end with a real vLLM: the CPU build `make vllm` installs, behind the agent, the router and the OpenAI SDK.

One `up --demo --catalog FILE` runs for the whole module with two models on vLLM: `tiny-vllm` (a tiny
random-weight Llama made here, tests/tiny_hf_model.py) and `broken-vllm` (the same weights with a bad engine
argument). The agent finds the cached vLLM with no setting and starts it from agent/engines/launch.py's argv; the
first request activates `tiny-vllm` and waits the ~50 s vLLM takes to start on 2 cores, while the broken one
fails. One vLLM start serves every test, in this order: the failed start, the OpenAI API through the router
with token usage stored, the engine load the router reads from vLLM's /metrics, the sleep/wake and LoRA
routes on the engine itself, and last a drain that waits for a stream in flight and stops the engine.

Every vLLM fact the project relies on is asserted here against vLLM 0.32.0: the server module and its
`--model`, `--host`/`--port`/`--served-model-name`, `/health`, the metric names (`vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:engine_sleep_state`, `vllm:lora_requests_info`),
the usage chunk of a stream, and the sleep and LoRA routes with their answers.

The profile's engine env carries what vLLM's CPU build needs here: `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache),
`HF_HUB_OFFLINE` (no hub lookups) and `VLLM_CPU_OMP_THREADS_BIND=nobind` (on 2 cores, a worker pinned to one
starves the API server: /metrics goes unanswered for seconds while it generates). The switches of the sleep and
LoRA routes (`VLLM_SERVER_DEV_MODE`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING`) are the agent's to set, so they are not
in it: the routes answering shows the agent set them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from catalog.models import Model, Profile
from catalog.parameters import dtype_bits
from catalog.sizing import profile_memory
from conftest import engine_port_range, wait_until
from tests.e2e.demo_stack import API_KEY, ROOT, demo_stack, engine_pids
from tests.e2e.engines.cutter import Cutter, start_router, streamed_text
from tests.e2e.engines.vllm_stack import tiny_model, vllm_install

pytestmark = [pytest.mark.e2e, pytest.mark.real_engine, pytest.mark.timeout(600)]

# A read of the router's or vLLM's side routes (/metrics, /is_sleeping, /v1/models): on 2 cores, with vLLM computing
# and other tests' stacks running beside, an answer may take seconds; a read is retried by the waits around it.
READ_TIMEOUT = 20

MODEL = "tiny-vllm"
BROKEN = "broken-vllm"
BAD_ARGUMENT = ["--max-num-seqs", "not-a-number"]
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# What vLLM's CPU build needs to start here (an engine of one request at a time, so a second one waits), its
# waiting requests run by priority (the router gives each request its class's).
ENGINE_ARGS = ["--max-model-len", "4096", "--max-num-seqs", "1", "--gpu-memory-utilization", "0.2"]
ENGINE_ARGS += ["--scheduling-policy", "priority"]
LORA_ARGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
# The catalog's adapters on MODEL: one PEFT folder under two names, so each is loaded as an adapter of its own.
ADAPTERS = ("tiny-lora-a", "tiny-lora-b")
# The profile's engine environment: what vLLM's CPU build needs here (the agent switches the sleep and LoRA routes on).
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    # Pinned to one of 2 cores, vLLM's worker leaves its API server too little CPU to answer /metrics while
    # it generates; unpinned it generates slower and answers.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
# Tokens of each answer the load and drain tests keep in flight. The tiny model generates 100 to 400 a second
# here, depending on what else runs, so a long answer asks for several: with `--max-num-seqs 1` vLLM runs them
# one after the other (the rest wait in its queue). Never cut short: vLLM is told to ignore the end-of-sequence
# token (the tiny model's random weights may choose it at any step, even greedily).
LONG = 3000
WHOLE = {"extra_body": {"ignore_eos": True}, "temperature": 1.0}
# The drain's stream: 6,000 tokens, 15 s at the fastest seen and a minute at the slowest, where the drain reaches
# the agent within a few seconds of the operator's call (four answers took two minutes on a slow machine).
DRAIN_ANSWERS = 2


def catalog_for(model_dir: Path) -> str:
    # LoRA on through the profile's adapter slots: the agent turns them into LORA_ARGS (agent/engines/launch.py).
    args = ", ".join(f'"{a}"' for a in ENGINE_ARGS)
    lora = model_dir.parent / "lora"
    env = json.dumps(ENGINE_ENV)  # JSON is YAML: a flow mapping of quoted strings
    bad = ", ".join(f'"{a}"' for a in BAD_ARGUMENT)
    return f"""
models:
  - name: {MODEL}
    source: {model_dir}
    profiles:
      - {{engine: vllm, gpu_class: L40S-48GB, gpus_per_node: 1, idle_timeout_seconds: 0, engine_args: [{args}],
         env: {env}, max_adapters: 2, max_adapter_rank: 8}}
    adapters:
      - {{name: {ADAPTERS[0]}, source: {lora}}}
      - {{name: {ADAPTERS[1]}, source: {lora}, aliases: [{ADAPTERS[1]}-alias]}}
  - name: {BROKEN}
    source: {model_dir}
    profiles:
      - {{engine: vllm, gpu_class: H100-80GB, gpus_per_node: 1, max_replicas: 1, engine_args: [{bad}],
         env: {env}}}
"""


class Stack:
    """The running `up`, an operator's REST token, and the first request that activated the tiny model."""

    def __init__(self, info: dict, models: Path):
        self.info = info
        self.models = models
        self.log: Path = info["log"]
        self.router = info["router"]
        self.control = f"http://127.0.0.1:{info['port']}"
        self.client = OpenAI(base_url=self.router + "/v1", api_key=API_KEY, timeout=300, max_retries=0)
        self.token = subprocess.run(
            [sys.executable, "manage.py", "create_api_token", "admin"], cwd=ROOT, env=info["env"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout.strip()  # fmt: skip
        self._pool = ThreadPoolExecutor(4)
        self.activation = self.submit(self.chat, "hello there", 8)

    def submit(self, fn, *args, **kwargs):
        return self._pool.submit(fn, *args, **kwargs)

    def chat(self, content: str, max_tokens: int, client: OpenAI | None = None, **options):
        options.setdefault("temperature", 0)  # greedy, unless several answers are asked for (vLLM refuses that)
        return (client or self.client).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, **options
        )

    def api(self, method: str, path: str, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"}
        return httpx.request(method, f"{self.control}/api/v1/{path}", headers=headers, timeout=30, **kwargs)

    def replica(self) -> dict:
        """The tiny model's replica, ready (the activation has been answered)."""
        self.activation.result(timeout=300)
        rows = self.api("GET", "replicas/", params={"state": "ready"}).json()["results"]
        (replica,) = [r for r in rows if r["model"] == MODEL]
        return replica

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    install = vllm_install()
    models = tiny_model(install)
    var = tmp_path_factory.mktemp("vllm-up")
    catalog = var / "catalog.yaml"
    catalog.write_text(catalog_for(models / "model"))
    env = {
        # Blank: agents find the cached install themselves.
        "LLMGW_VLLM_COMMAND": "",
        "LLMGW_ENGINE_PORT_RANGE": engine_port_range(4),
        "LLMGW_ENGINE_POLL_SECONDS": "0.5",  # each read may take 0.5 s: a busy vLLM answers late
        "LLMGW_HEARTBEAT_SECONDS": "0.5",
        "LLMGW_ACTIVATION_TIMEOUT_SECONDS": "300",
    }
    with demo_stack(var, "--catalog", str(catalog), env=env) as info:
        running = Stack(info | {"install": install}, models)
        try:
            yield running
        finally:
            running.close()


def metric_samples(text: str, family: str) -> list:
    return [s for f in text_string_to_metric_families(text) if f.name == family for s in f.samples if s.name == family]


def test_a_bad_engine_argument_answers_model_failed_with_vllms_own_last_line(stack):
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as failure:
        stack.client.chat.completions.create(model=BROKEN, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert failure.value.status_code == 503
    error = failure.value.body
    assert error["code"] == "model_failed", error
    # The agent's first line, then vLLM's own last line of output: its argument parser's complaint.
    assert (
        "engine exited with code 2: api_server.py: error: argument --max-num-seqs: invalid int value: "
        in (error["message"])
    ), error
    assert time.monotonic() - started < 120
    # No more restarts of a model that cannot start: they would take the machine from the other tests.
    assert stack.api("PATCH", f"models/{BROKEN}", json={"enabled": False}).status_code == 200


def test_the_agent_starts_the_cached_vllm_with_the_production_argv(stack):
    replica = stack.replica()
    port = int(replica["endpoint_url"].rsplit(":", 1)[1])
    assert replica["endpoint_url"] == f"http://127.0.0.1:{port}"
    started = re.search(rf"shard \d+: started (.* --served-model-name {MODEL} .*) \(pid (\d+)\)", stack.log.read_text())
    assert started, "the agent logs the argv it ran"
    install = stack.info["install"]
    model_dir = stack.models / "model"
    expected = (
        f"{install.python} -m {SERVER_MODULE} --model {model_dir} --host 127.0.0.1 --port {port} "
        f"--served-model-name {MODEL} --tensor-parallel-size 1 {' '.join(ENGINE_ARGS + LORA_ARGS)}"
    )
    # The line is the environment the agent added (the profile's, then the GPUs placed), then the argv.
    added, argv = started.group(1).split(f" {install.python} ", 1)
    assert f"{install.python} {argv}" == expected
    placed = {"CUDA_VISIBLE_DEVICES=0", "LLMGW_GPU_MEMORY_MIB=49152"}  # the simulated L40S-48GB it was given
    # The sleep routes (a vLLM replica is placed able to sleep) and the LoRA routes (the profile has slots).
    switches = {"VLLM_SERVER_DEV_MODE=1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true"}
    assert set(added.split()) == {f"{name}={value}" for name, value in ENGINE_ENV.items()} | placed | switches
    assert int(started.group(2)) in engine_pids(stack.info["var"], SERVER_MODULE.encode())
    # It listens on the node's management address only, not on every interface.
    listening = Path("/proc/net/tcp").read_text()
    assert f"0100007F:{port:04X} 00000000:0000 0A" in listening
    assert f"00000000:{port:04X} 00000000:0000 0A" not in listening


# What vLLM 0.32's CPU build says of its memory at start-up (read in the cached install's source):
# * the engine's config line, `dtype=torch.bfloat16`: what it holds the weights in (a float32 checkpoint is cast);
# * cpu_worker.determine_available_memory, `Explicitly set (1.0/12.21) GiB for KV cache on node 0.`: the KV space
#   (VLLM_CPU_KVCACHE_SPACE, whole GiB, so its bytes are exact);
# * kv_cache_utils, `CPU KV cache size: 1,048,576 tokens, ...`: how many tokens that space holds, whole blocks.
# Bytes per token = space ÷ tokens: exact to one block, far inside ±5%, whatever the model's size. Its CPU model
# runner logs no weights size (cpu_model_runner.load_model: `Starting to load model %s...` only; the GPU runner's
# `Model loading took %s GiB` comes from CUDA memory stats), so vLLM's weights figure is its logged dtype × the
# checkpoint's parameters as the safetensors library in vLLM's own environment counts them: a reader other than
# ours, and vLLM's own cast rule. (LoRA buffers vLLM adds for --enable-lora are not weights and not counted.)
VLLM_DTYPE = re.compile(r"with config: model=.*?dtype=torch\.(\w+)")
VLLM_KV_SPACE = re.compile(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache")
VLLM_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
TORCH_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
COUNT_PARAMETERS = """
import json, math, pathlib, sys
from safetensors import safe_open
total = 0
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.safetensors")):
    with safe_open(str(path), framework="pt") as f:
        total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
print(json.dumps(total))
"""


def test_the_memory_estimate_matches_what_vllm_says_of_its_weights_and_kv_cache(stack):
    stack.replica()  # started: its start-up lines are in the log
    log = stack.log.read_text()
    dtype, space, tokens = (pattern.search(log) for pattern in (VLLM_DTYPE, VLLM_KV_SPACE, VLLM_KV_TOKENS))
    assert dtype and space and tokens, "vLLM's start-up lines on dtype and KV cache"
    model_dir = stack.models / "model"
    # The estimate the control plane makes for this profile (unsaved rows: sizing reads the local folder itself).
    profile = Profile(
        model=Model(name=MODEL, source=str(model_dir)), engine="vllm", gpu_class="L40S-48GB", gpus_per_node=1,
        engine_args=ENGINE_ARGS + LORA_ARGS,
    )  # fmt: skip
    estimate = profile_memory(profile)
    assert estimate.weights.source == "headers" and estimate.kv is not None

    counted = subprocess.run(
        [str(stack.info["install"].python), "-c", COUNT_PARAMETERS, str(model_dir)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    vllm_weights = json.loads(counted.stdout) * TORCH_BYTES[dtype.group(1)]
    assert estimate.weights.bytes == pytest.approx(vllm_weights, rel=0.05)

    # VLLM_CPU_KVCACHE_SPACE is whole GiB; the log rounds it to 2 decimals, which pins it. Measured here: 1 GiB
    # for 1,048,576 tokens, 1024 bytes per token, as estimated; weights 1,443,072 parameters × 2 bytes, as estimated.
    kv_space = round(float(space.group(1))) * 2**30
    assert kv_space == int(ENGINE_ENV["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
    vllm_per_token = kv_space / int(tokens.group(1).replace(",", ""))
    kv_bits = dtype_bits(estimate.kv_dtype or estimate.weights.compute_dtype)
    assert estimate.kv.bytes_per_token(kv_bits) == pytest.approx(vllm_per_token, rel=0.05)


def test_chat_completions_and_streams_through_the_router_with_usage_stored_per_key(stack):
    first = stack.activation.result(timeout=300)
    assert first.model == MODEL and first.system_fingerprint.startswith("vllm-0.32.0")
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 8
    # A key of its own, so what is stored is exactly what this test asked for.
    created = stack.api("POST", "keys/", json={"name": "vllm-usage"})
    assert created.status_code == 201, created.text
    client = OpenAI(base_url=stack.router + "/v1", api_key=created.json()["key"], timeout=60, max_retries=0)

    chat = stack.chat("hello there", 6, client)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 6 and chat.usage.total_tokens == chat.usage.prompt_tokens + 6
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert completion.choices[0].text and completion.usage.completion_tokens == 5

    chunks = list(stack.chat("stream please", 7, client, stream=True, stream_options={"include_usage": True}))
    assert len([c for c in chunks if c.choices]) >= 2 and chunks[-1].choices == []
    streamed = chunks[-1].usage
    assert streamed is not None and streamed.completion_tokens == 7
    # Not asked for: the router still asks vLLM for the usage chunk, counts it and drops it.
    quiet = list(stack.chat("stream please", 7, client, stream=True))
    assert quiet and all(c.usage is None for c in quiet)
    assert quiet[-1].choices[0].finish_reason == "length"

    prompt = chat.usage.prompt_tokens + completion.usage.prompt_tokens + 2 * streamed.prompt_tokens
    expected = {"requests": 4, "prompt_tokens": prompt, "completion_tokens": 6 + 5 + 7 + 7}

    def stored():
        rows = stack.api("GET", "usage/", params={"key": "vllm-usage", "model": MODEL}).json()["results"]
        totals = {name: sum(r[name] for r in rows) for name in expected}
        return totals if totals == expected else None

    wait_until(stored, 20, 0.3, describe=lambda: stack.api("GET", "usage/").text)


def test_anthropic_messages_and_responses_through_the_router_with_usage_stored_per_key(stack):
    stack.activation.result(timeout=300)
    created = stack.api("POST", "keys/", json={"name": "vllm-in-out"})
    assert created.status_code == 201, created.text
    headers = {"Authorization": f"Bearer {created.json()['key']}"}
    # Anthropic's Messages API, streamed: its usage in message_start and message_delta, relayed as vLLM sent it.
    ask = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hello"}]}
    with httpx.stream("POST", stack.router + "/v1/messages", headers=headers, json=ask, timeout=60) as answer:
        assert answer.status_code == 200
        raw = answer.read().decode()
    events = {e.split("\n")[0]: json.loads(e.split("data: ", 1)[1]) for e in raw.split("\n\n") if "data: " in e}
    assert {"event: message_start", "event: message_delta", "event: message_stop"} <= set(events)
    messages_usage = events["event: message_delta"]["usage"]
    assert 1 <= messages_usage["output_tokens"] <= 4
    # OpenAI's Responses API, not streamed: its usage counts input and output tokens, cached ones among the input.
    responses = httpx.post(
        stack.router + "/v1/responses",
        headers=headers,
        json={"model": MODEL, "input": "Once upon a time", "max_output_tokens": 3},
        timeout=60,
    )
    assert responses.status_code == 200, responses.text
    responses_usage = responses.json()["usage"]
    assert 1 <= responses_usage["output_tokens"] <= 3
    prompt = messages_usage["input_tokens"] + responses_usage["input_tokens"]
    completion = messages_usage["output_tokens"] + responses_usage["output_tokens"]
    expected = {"requests": 2, "prompt_tokens": prompt, "completion_tokens": completion}

    def stored():
        rows = stack.api("GET", "usage/", params={"key": "vllm-in-out", "model": MODEL}).json()["results"]
        totals = {name: sum(r[name] for r in rows) for name in expected}
        return totals if totals == expected else None

    wait_until(stored, 20, 0.3, describe=lambda: stack.api("GET", "usage/", params={"key": "vllm-in-out"}).text)


def test_the_router_reads_waiting_requests_and_kv_usage_from_vllms_metrics(stack):
    replica = str(stack.replica()["id"])
    # Not streamed: a fast stream keeps vLLM's API server so busy on 2 cores that /metrics answers late.
    long = stack.submit(stack.chat, "count to many", LONG, n=2, **WHOLE)
    gauges: list[float] = []

    def the_router_holds_it() -> bool:
        gauges.append(router_gauge(stack, "llmgw_router_in_flight_requests"))
        return gauges[-1] == 1.0

    wait_until(the_router_holds_it, 30, 0.02, describe=lambda: f"in flight: {sorted(set(gauges))}, done: {long.done()}")
    # The engine runs one sequence at a time (--max-num-seqs 1): the long answer's second, and then a second
    # request, wait in vLLM's own queue (one or two waiting, as the router's poll falls).
    waiting = stack.submit(stack.chat, "and me", 3)
    seen: dict[str, list[float]] = {"waiting": [], "kv": []}

    def router_saw_the_queue_and_the_cache_in_use():
        text = httpx.get(stack.router + "/metrics", timeout=READ_TIMEOUT).text
        for key, family in (("waiting", "waiting_requests"), ("kv", "kv_cache_usage_ratio")):
            samples = metric_samples(text, f"llmgw_router_engine_{family}")
            seen[key] += [s.value for s in samples if s.labels.get("replica") == replica]
        return any(v >= 1 for v in seen["waiting"]) and any(0 < v < 1 for v in seen["kv"])

    # The router polls every 0.5 s here; on a busy machine vLLM's API server answers in bursts.
    wait_until(router_saw_the_queue_and_the_cache_in_use, 30, 0.1, describe=lambda: f"router read {seen}")
    # The second request is served after the long answer's two (one sequence at a time): wait for those first,
    # with the slowest rate seen (6,000 tokens at 40 a second on a loaded machine) in mind.
    assert long.result(300).usage.completion_tokens == 2 * LONG
    assert waiting.result(60).choices[0].finish_reason == "length"
    # The names the router and the agent read (router/picking/engine_load.py, agent/engines/load.py), as vLLM serves
    # them: the KV gauge under its new name only, each gauge per engine core (the router sums label sets).
    families = {f.name: f for f in text_string_to_metric_families(engine_metrics(stack))}
    read = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    assert set(read) <= set(families) and "vllm:gpu_cache_usage_perc" not in families
    assert all(s.labels.get("engine") == "0" for name in read for s in families[name].samples)


def test_vllm_scheduling_by_priority_takes_each_requests_class_as_its_priority(stack):
    """The profile starts vLLM with `--scheduling-policy priority`, so the router sets every request's `priority`
    to its class's rank (0 interactive, 1 standard, 2 batch). vLLM takes them: a vLLM without that policy refuses
    any priority but 0. (The order its queue then runs them in is tested on the mock engine, which orders its queue
    as vLLM's does: here vLLM's worker takes both cores while it generates, so the order is not observable in time.)"""
    stack.replica()
    made = stack.api("POST", "keys/", json={"name": "interactive", "priority_class": "interactive"})
    assert made.status_code == 201, made.text
    interactive = OpenAI(base_url=stack.router + "/v1", api_key=made.json()["key"], timeout=300, max_retries=0)
    answers = [
        stack.chat("as batch", 3, extra_headers={"LLMGW-Priority": "batch"}, **WHOLE),
        stack.chat("as interactive", 3, client=interactive, **WHOLE),
        # A client's own priority is overwritten by its class's, never passed on.
        stack.chat("as standard", 3, temperature=1.0, extra_body={"ignore_eos": True, "priority": -5}),
    ]
    assert [answer.choices[0].finish_reason for answer in answers] == ["length"] * 3


def test_a_stream_cut_midway_is_continued_token_for_token_on_another_endpoint(stack, tmp_path):
    """Router-only mode knows the engine twice: behind a cutter that ends the answer after 9 events (as its death
    would), and directly. The stream goes on from the second by token ids, the same text and tokens as the
    uninterrupted answer (bench/stream_exactness.py measures twenty such streams each way)."""
    engine = int(engine_url(stack).rsplit(":", 1)[1])
    cutter = Cutter(engine, [9])
    router, url, key = start_router(tmp_path, MODEL, "token_ids", cutter.port, engine)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "stream": True, "max_tokens": 24}
        body |= {"temperature": 0, "ignore_eos": True, "return_token_ids": True}
        reference = streamed_text(engine_url(stack), body)
        continued = streamed_text(url, body, key)
        assert continued == reference and len(reference[1]) == 24 and not reference[2]
        families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=READ_TIMEOUT).text)
        counted = [s for f in families for s in f.samples if s.name == "llmgw_router_stream_continuations_total"]
        assert [(s.labels["outcome"], s.value) for s in counted] == [("continued", 1.0)]
    finally:
        router.terminate()
        router.wait(10)


def engine_url(stack) -> str:
    return stack.replica()["endpoint_url"]


def engine_metrics(stack) -> str:
    return httpx.get(engine_url(stack) + "/metrics", timeout=READ_TIMEOUT).text


def router_gauge(stack, family: str) -> float:
    return sum(s.value for s in metric_samples(httpx.get(stack.router + "/metrics", timeout=READ_TIMEOUT).text, family))


def engine_gauge(url: str, family: str) -> float:
    """A gauge of the engine's own /metrics, summed over its label sets."""
    return sum(s.value for s in metric_samples(httpx.get(url + "/metrics", timeout=READ_TIMEOUT).text, family))


def sleep_state(stack) -> dict[str, float]:
    samples = metric_samples(engine_metrics(stack), "vllm:engine_sleep_state")
    return {s.labels["sleep_state"]: s.value for s in samples}


def test_sleep_and_wake_routes_answer_and_the_sleep_state_gauge_follows(stack):
    url = engine_url(stack)
    assert sleep_state(stack) == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    slept = httpx.post(f"{url}/sleep", params={"level": 1}, timeout=30)
    assert (slept.status_code, slept.json()) == (200, {"status": "sleeping", "level": 1})
    assert httpx.get(f"{url}/is_sleeping", timeout=READ_TIMEOUT).json() == {"is_sleeping": True}
    assert sleep_state(stack) == {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0}
    # A request to a sleeping engine is held, not refused; waking it up answers it. While held it is neither
    # running nor waiting in vLLM's own gauges: a drain reading them would not wait for it.
    held = stack.submit(stack.chat, "are you awake", 3)
    time.sleep(1.0)
    assert not held.done()
    assert engine_gauge(url, "vllm:num_requests_running") == engine_gauge(url, "vllm:num_requests_waiting") == 0
    woke = httpx.post(f"{url}/wake_up", timeout=30)
    assert woke.status_code == 200 and woke.json()["status"] == "awake"
    assert httpx.get(f"{url}/is_sleeping", timeout=READ_TIMEOUT).json() == {"is_sleeping": False}
    assert sleep_state(stack) == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    assert held.result(30).choices[0].finish_reason == "length"
    # Waking by memory pool (what agent/engines/sleep.py does after level 2, and the mock imitates): a tag that
    # does not sleep wakes nothing and is no error; vLLM stays paused, and says it sleeps, until both are back.
    assert httpx.post(f"{url}/sleep", params={"level": 2}, timeout=30).json() == {"status": "sleeping", "level": 2}
    for tags, status in ((["foo"], "sleeping"), (["weights"], "sleeping"), (["kv_cache"], "awake")):
        woke = httpx.post(f"{url}/wake_up", params={"tags": tags}, timeout=30)
        assert (woke.status_code, woke.json()) == (200, {"status": status, "tags": tags})
        assert httpx.get(f"{url}/is_sleeping", timeout=READ_TIMEOUT).json() == {"is_sleeping": status == "sleeping"}
        assert sleep_state(stack)["discard_all"] == float(status == "sleeping")


def test_lora_adapters_load_serve_and_unload_at_run_time(stack):
    url = engine_url(stack)
    lora = str(stack.models / "lora")
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "ad1", "lora_path": lora}, timeout=30)
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'ad1' added successfully.")
    listed = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=READ_TIMEOUT).json()["data"]}
    assert listed["ad1"]["parent"] == MODEL and listed["ad1"]["root"] == lora
    engine = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=30, max_retries=0)
    reply = engine.chat.completions.create(model="ad1", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert reply.model == "ad1" and reply.usage.completion_tokens == 3
    info = metric_samples(engine_metrics(stack), "vllm:lora_requests_info")
    assert {s.labels["max_lora"] for s in info} == {"2"}
    assert any(s.labels["running_lora_adapters"] == "ad1" for s in info), info
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "ad1"}, timeout=30)
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'ad1' removed successfully.")
    assert "ad1" not in {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=READ_TIMEOUT).json()["data"]}
    again = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "ad1"}, timeout=30)
    assert again.status_code == 404 and again.json()["error"]["type"] == "NotFoundError"


def test_the_catalogs_adapters_are_loaded_by_the_control_plane_and_served_through_the_router(stack):
    """Two catalog adapters end to end: a request names each (one by its alias); the router holds it, the tick
    assigns it to the replica, the agent loads it into vLLM (load_adapter), and the answer comes from vLLM under
    the adapter's name, its tokens stored per adapter. Then one is disabled and the other goes idle: the tick
    unloads each from vLLM (unload_adapter)."""
    replica = stack.replica()
    created = stack.api("POST", "keys/", json={"name": "vllm-adapters"})
    assert created.status_code == 201, created.text
    client = OpenAI(base_url=stack.router + "/v1", api_key=created.json()["key"], timeout=120, max_retries=0)
    listed = {m.id: m for m in client.models.list().data}
    assert listed[ADAPTERS[0]].model_extra["parent"] == MODEL

    for asked, served in ((ADAPTERS[0], ADAPTERS[0]), (f"{ADAPTERS[1]}-alias", ADAPTERS[1])):
        reply = client.chat.completions.create(
            model=asked, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
        )
        assert reply.model == served and reply.usage.completion_tokens == 3
        assert re.search(rf"shard \d+: adapter {served} loaded in [0-9.]+ s", stack.log.read_text())
    held = {m["id"]: m for m in httpx.get(f"{replica['endpoint_url']}/v1/models", timeout=READ_TIMEOUT).json()["data"]}
    assert {held[name]["parent"] for name in ADAPTERS} == {MODEL}

    def stored():
        rows = stack.api("GET", "usage/", params={"key": "vllm-adapters"}).json()["results"]
        per_model = {row["model"]: row["completion_tokens"] for row in rows}
        return per_model if per_model == {ADAPTERS[0]: 3, ADAPTERS[1]: 3} else None

    wait_until(stored, 20, 0.3, describe=lambda: stack.api("GET", "usage/").text)

    # An operator disables the second: the tick unloads it from vLLM (unload_adapter) at once.
    keys = ("name", "source", "enabled", "rank", "aliases")
    adapters = [{k: a[k] for k in keys} for a in stack.api("GET", f"models/{MODEL}").json()["adapters"]]
    for adapter in adapters:
        adapter["enabled"] = adapter["name"] != ADAPTERS[1]
    assert stack.api("PATCH", f"models/{MODEL}", json={"adapters": adapters}).status_code == 200
    wait_until(lambda: re.search(rf"adapter {ADAPTERS[1]} unloaded", stack.log.read_text()), 20, 0.2)
    held = {m["id"] for m in httpx.get(f"{replica['endpoint_url']}/v1/models", timeout=READ_TIMEOUT).json()["data"]}
    assert ADAPTERS[0] in held and ADAPTERS[1] not in held

    # Idle past its base profile's idle timeout (2 s for a moment; min 1 keeps the base itself), the first goes too.
    profile = {
        name: value
        for name, value in stack.api("GET", f"models/{MODEL}").json()["profiles"][0].items()
        if name not in ("id", "order", "start_seconds")
    }
    quick = stack.api(
        "PATCH", f"models/{MODEL}", json={"profiles": [profile | {"idle_timeout_seconds": 2, "min_replicas": 1}]}
    )
    assert quick.status_code == 200, quick.text
    try:
        wait_until(lambda: re.search(rf"adapter {ADAPTERS[0]} unloaded", stack.log.read_text()), 30, 0.2)
    finally:
        assert stack.api("PATCH", f"models/{MODEL}", json={"profiles": [profile]}).status_code == 200
    held = {m["id"] for m in httpx.get(f"{replica['endpoint_url']}/v1/models", timeout=READ_TIMEOUT).json()["data"]}
    assert held.isdisjoint(ADAPTERS)
    assert stack.replica()["id"] == replica["id"]  # the base replica stayed


def test_a_drain_waits_for_the_stream_in_flight_then_stops_the_engine(stack):
    """Last: it stops the module's engine. The stream is long (LONG) so that it is still running when the drain
    reaches the agent, a few seconds after the operator's call (unpublish, a tick, then `drain_shard`)."""
    replica = stack.replica()["id"]
    engines = engine_pids(stack.info["var"], SERVER_MODULE.encode())
    assert engines
    finished: list[float] = []
    chunks: list = []

    def stream():
        answer = stack.chat(
            "a long answer", LONG, n=DRAIN_ANSWERS, stream=True, stream_options={"include_usage": True}, **WHOLE
        )
        for chunk in answer:
            chunks.append(chunk)
        finished.append(time.monotonic())

    streaming = threading.Thread(target=stream)
    streaming.start()
    # Drained as soon as the router has sent it to the engine, not once chunks come back: on a busy machine
    # vLLM's API server sends a fast stream in bursts, seconds late.
    wait_until(lambda: router_gauge(stack, "llmgw_router_in_flight_requests") == 1.0, 30, 0.02)
    assert stack.api("POST", f"replicas/{replica}/drain").status_code == 200
    wait_until(lambda: re.search(r"shard \d+: draining", stack.log.read_text()), 15, 0.1)
    assert streaming.is_alive(), "the stream should still be in flight when the drain begins"
    streaming.join(240)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == DRAIN_ANSWERS * LONG, "the stream finished whole"
    stopped = re.compile(r"shard \d+ on gpu-c: stopped \(drained: no running requests")
    wait_until(lambda: stopped.search(stack.log.read_text()), 15, 0.1, describe=lambda: stack.log.read_text()[-3000:])
    wait_until(lambda: not engine_pids(stack.info["var"], SERVER_MODULE.encode()), 15, 0.2)
    # Right after: the agent reads vLLM's running count every half second, and vLLM stops in a few seconds.
    assert time.monotonic() - finished[0] < 10


def test_the_agent_puts_the_modules_vllm_to_sleep_and_wakes_it_through_its_own_sleep_calls(stack):
    """The agent's sleep and wake calls (agent/engines/sleep.py, what agent/hibernation.py runs for sleep_shard and
    wake_shard) against the real vLLM: the state machine is real (`/is_sleeping`, the engine_sleep_state gauge, a
    request held while asleep and served after the wake; after level 2 the wake by parts, still paused with the
    weights alone back, the weights reloaded and the prefix cache reset before the KV cache's wake resumes it), but
    on CPU the memory is not freed: vLLM's CPU worker ignores that part ("sleep mode is not supported on CPU, ignore
    it"), which is why the agent does not pass it `--enable-sleep-mode` on simulated GPUs."""
    from agent.engines.sleep import EngineSleep

    stack.chat("hello again", 2)  # starts the engine again if a drain above stopped it
    (replica,) = wait_until(
        lambda: [r for r in stack.api("GET", "replicas/", params={"state": "ready"}).json()["results"]
                 if r["model"] == MODEL],
        30, 0.5,
    )  # fmt: skip
    url = replica["endpoint_url"]
    engine = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)

    def gauge() -> dict[str, float]:
        samples = metric_samples(httpx.get(url + "/metrics", timeout=READ_TIMEOUT).text, "vllm:engine_sleep_state")
        return {s.labels["sleep_state"]: s.value for s in samples}

    async def sleep_and_wake(level: int) -> None:
        # Each call of the wake: what vLLM answered, and whether the request held during the sleep was done by then.
        answered: list[tuple[str, object, bool]] = []
        waking: list = []

        async def record(response: httpx.Response) -> None:
            await response.aread()
            if waking:
                body = response.json() if response.headers.get("content-type") == "application/json" else response.text
                answered.append((f"{response.request.method} {response.request.url.raw_path.decode()}", body,
                                 waking[0].done()))  # fmt: skip

        async with httpx.AsyncClient(trust_env=False, event_hooks={"response": [record]}) as client:
            calls = EngineSleep(client, url, "vllm")
            await calls.sleep(level)
            assert await calls.is_sleeping()
            assert gauge() == {"awake": 0.0, "weights_offloaded": float(level == 1), "discard_all": float(level == 2)}
            held = stack.submit(
                engine.chat.completions.create, model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            time.sleep(1.0)
            assert not held.done(), "a request to a sleeping engine is held"
            waking.append(held)
            await calls.wake(level)
            waking.clear()
            assert not await calls.is_sleeping()
            assert gauge() == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
            assert held.result(60).usage.completion_tokens == 3
        if level == 2:
            # By parts: vLLM stays paused (the request held) until the KV cache, woken last, is back.
            assert [(call, body) for call, body, _ in answered[:4]] == [
                ("POST /wake_up?tags=weights", {"status": "sleeping", "tags": ["weights"]}),
                ("POST /collective_rpc", {"results": [None]}),
                ("POST /reset_prefix_cache", {"success": True}),
                ("POST /wake_up?tags=kv_cache", {"status": "awake", "tags": ["kv_cache"]}),
            ]
            assert [done for _, _, done in answered[:3]] == [False, False, False]
        else:
            assert answered[0][:2] == ("POST /wake_up", {"status": "awake", "tags": None})

    import asyncio

    asyncio.run(sleep_and_wake(1))
    asyncio.run(sleep_and_wake(2))  # its wake reloads the weights (POST /collective_rpc) and resets the prefix cache


def test_the_control_plane_puts_the_idle_vllm_to_sleep_and_the_next_request_wakes_the_same_engine(stack):
    """The hibernate tier end to end on the real vLLM: the profile's `sleep_after_seconds` makes the tick put the
    idle replica to sleep (sleep_shard to the agent, which sleeps the engine through its own calls); the next
    request through the router is held while the tick wakes it (wake_shard) and is answered by the same engine
    process, never restarted. On CPU the state machine is real and the memory is not freed (see the test above)."""
    stack.chat("are you up", 2)  # starts the engine again if a drain above stopped it
    (replica,) = wait_until(
        lambda: [r for r in stack.api("GET", "replicas/", params={"state": "ready"}).json()["results"]
                 if r["model"] == MODEL],
        30, 0.5,
    )  # fmt: skip
    url, pids = replica["endpoint_url"], engine_pids(stack.info["var"], SERVER_MODULE.encode())
    profiles = [
        {name: value for name, value in p.items() if name not in ("id", "order", "start_seconds")}
        for p in stack.api("GET", f"models/{MODEL}").json()["profiles"]
    ]

    def sleep_after(seconds):
        changed = stack.api(
            "PATCH", f"models/{MODEL}", json={"profiles": [profiles[0] | {"sleep_after_seconds": seconds}]}
        )
        assert changed.status_code == 200, changed.text

    sleep_after(2)
    try:
        wait_until(
            lambda: httpx.get(f"{url}/is_sleeping", timeout=READ_TIMEOUT).json()["is_sleeping"],
            60, 0.5, describe=lambda: stack.log.read_text()[-3000:],
        )  # fmt: skip
        sleepers = wait_until(
            lambda: [r for r in stack.api("GET", "replicas/", params={"state": "sleeping"}).json()["results"]
                     if r["id"] == replica["id"]],
            30, 0.3,
        )  # fmt: skip
        assert sleepers[0]["sleeping_level"] in (1, 2)
        sleep_after(None)  # the woken replica must not fall asleep again under the assertions below
        answer = stack.chat("and now", 3)
        assert answer.usage.completion_tokens == 3
        assert httpx.get(f"{url}/is_sleeping", timeout=READ_TIMEOUT).json() == {"is_sleeping": False}
        woken = stack.api("GET", f"replicas/{replica['id']}").json()
        assert (woken["state"], woken["endpoint_url"]) == ("ready", url)
        assert engine_pids(stack.info["var"], SERVER_MODULE.encode()) == pids, "woken, not started again"
        assert re.search(rf"waking replicas \[{replica['id']}\]", stack.log.read_text())
    finally:
        sleep_after(None)
