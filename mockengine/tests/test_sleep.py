"""The mock engine's cold start and vLLM's sleep, run as a real subprocess and spoken to over HTTP on 127.0.0.1."""

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import free_port, wait_until
from mockengine.sleep import NO_WEIGHTS
from mockengine.tests.test_server import MODEL, PROJECT, sse_events

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "are you awake"}]}


def launch(*extra: str, dev_mode: bool = True) -> tuple[subprocess.Popen, str]:
    """A mock engine serving (or, with --load-seconds, still loading); the sleep routes only with `dev_mode`."""
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mockengine", "--port", str(port), "--model", MODEL, *extra],
        cwd=PROJECT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def answers():
        try:
            return httpx.get(base + "/metrics", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(answers, 20, 0.05)  # a deadline: a Python start on a loaded machine takes seconds
    return proc, base


@pytest.fixture
def engine(request):
    proc, base = launch(*getattr(request, "param", ()))
    with httpx.Client(base_url=base, timeout=10, trust_env=False) as client, ThreadPoolExecutor(2) as pool:
        client.pool = pool
        yield client
    proc.terminate()
    proc.wait(5)


def sleep_state(client) -> dict[str, float]:
    states = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("vllm:engine_sleep_state{"):
            labels, value = line.rsplit(" ", 1)
            states[labels.split('sleep_state="')[1].split('"')[0]] = float(value)
    return states


def test_load_seconds_keep_health_503_and_hold_requests_until_loaded():
    started = time.monotonic()
    proc, base = launch("--load-seconds", "3")
    try:
        with httpx.Client(base_url=base, timeout=10, trust_env=False) as client, ThreadPoolExecutor(1) as pool:
            assert client.get("/health").status_code == 503
            early = pool.submit(client.post, "/v1/chat/completions", json=CHAT)
            wait_until(lambda: client.get("/health").status_code == 200, 5, 0.05)
            # From the launch, Python's start-up included, as an engine's cold start is counted. The mock reads its
            # own age from /proc (uptime and start time in 10 ms ticks), so it may be ready up to 20 ms early.
            loaded = time.monotonic() - started
            assert 2.98 <= loaded < 4.5
            assert early.result(5).json()["choices"][0]["finish_reason"] == "stop"
    finally:
        proc.terminate()
        proc.wait(5)


@pytest.mark.parametrize("engine", [("--wake-seconds", "0.5")], indirect=True)
def test_a_request_to_a_sleeping_engine_is_held_and_served_once_woken(engine):
    assert engine.get("/is_sleeping").json() == {"is_sleeping": False}
    assert sleep_state(engine) == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    slept = engine.post("/sleep", params={"level": 1})
    assert (slept.status_code, slept.json()) == (200, {"status": "sleeping", "level": 1})
    assert engine.get("/is_sleeping").json() == {"is_sleeping": True}
    assert sleep_state(engine) == {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0}
    held = engine.pool.submit(engine.post, "/v1/chat/completions", json=CHAT)
    time.sleep(0.5)
    assert not held.done()
    # As in vLLM, a held request is neither running nor waiting.
    assert "vllm:num_requests_running{" in engine.get("/metrics").text
    assert 'vllm:num_requests_running{engine="0",model_name="mock-small"} 0.0' in engine.get("/metrics").text
    waking = time.monotonic()
    woke = engine.post("/wake_up")
    assert (woke.status_code, woke.json()) == (200, {"status": "awake", "tags": None})
    assert 0.5 <= time.monotonic() - waking < 2.0  # --wake-seconds
    assert engine.get("/is_sleeping").json() == {"is_sleeping": False}
    assert sleep_state(engine) == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    assert held.result(5).json()["choices"][0]["message"]["content"] == f"mock reply from {MODEL}: are you awake"


def test_after_level_2_a_wake_by_parts_serves_what_was_queued_only_once_the_weights_are_reloaded(engine):
    # vLLM's order: the weights' memory back (still paused), the weights reloaded, the prefix cache reset,
    # then the KV cache, whose wake resumes scheduling.
    assert engine.post("/sleep", params={"level": 2}).json() == {"status": "sleeping", "level": 2}
    assert sleep_state(engine) == {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 1.0}
    held = engine.pool.submit(engine.post, "/v1/chat/completions", json=CHAT)
    woke = engine.post("/wake_up", params={"tags": "weights"})
    assert (woke.status_code, woke.json()) == (200, {"status": "sleeping", "tags": ["weights"]})
    assert engine.get("/is_sleeping").json() == {"is_sleeping": True}
    assert sleep_state(engine) == {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 1.0}
    assert engine.post("/collective_rpc", json={"method": "reload_weights"}).json() == {"results": [None]}
    assert engine.post("/reset_prefix_cache").json() == {"success": True}
    time.sleep(0.3)
    assert not held.done(), "scheduling resumes only once the KV cache is back too"
    woke = engine.post("/wake_up", params={"tags": "kv_cache"})
    assert (woke.status_code, woke.json()) == (200, {"status": "awake", "tags": ["kv_cache"]})
    assert engine.get("/is_sleeping").json() == {"is_sleeping": False}
    assert sleep_state(engine) == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    assert held.result(5).json()["choices"][0]["message"]["content"] == f"mock reply from {MODEL}: are you awake"


def test_after_level_2_a_whole_wake_runs_what_was_queued_at_once_on_weights_not_reloaded(engine):
    # As vLLM: a tagless wake resumes scheduling in the same call, before any reload can follow.
    engine.post("/sleep", params={"level": 2})
    held = engine.pool.submit(engine.post, "/v1/chat/completions", json=CHAT)
    time.sleep(0.3)
    assert engine.post("/wake_up").json() == {"status": "awake", "tags": None}
    assert held.result(5).json()["choices"][0]["message"]["content"] == " ".join([NO_WEIGHTS] * 7)
    engine.post("/collective_rpc", json={"method": "reload_weights"})
    served = engine.post("/v1/chat/completions", json=CHAT).json()
    assert served["choices"][0]["message"]["content"] == f"mock reply from {MODEL}: are you awake"


def test_tags_wake_only_what_sleeps_and_the_weights_reload_only_into_woken_memory(engine):
    engine.post("/sleep", params={"level": 2})
    # The weights' memory still sleeps: writing into it would fault on a GPU.
    refused = engine.post("/collective_rpc", json={"method": "reload_weights"})
    assert refused.status_code == 500 and "wake it (tags=weights) first" in refused.json()["error"]["message"]
    # As vLLM: a tag that does not sleep (unknown, or awake already) wakes nothing and is no error.
    for tags in (["foo"], ["weights", "foo"], ["scheduling"]):
        assert engine.post("/wake_up", params={"tags": tags}).json() == {"status": "sleeping", "tags": tags}
    assert engine.post("/wake_up", params={"tags": "kv_cache"}).json()["status"] == "sleeping"
    assert engine.post("/wake_up", params={"tags": "kv_cache"}).json()["status"] == "sleeping"
    assert engine.post("/wake_up", params={"tags": ["weights", "kv_cache"]}).json()["status"] == "sleeping"
    woke = engine.post("/wake_up", params={"tags": "weights"})
    assert woke.json() == {"status": "awake", "tags": ["weights"]}
    assert engine.post("/wake_up", params={"tags": "weights"}).json() == {"status": "awake", "tags": ["weights"]}


@pytest.mark.parametrize("engine", [("--token-delay-ms", "100", "--prefix-cache-tokens", "4096")], indirect=True)
def test_the_prefix_cache_is_reset_by_a_sleep_and_not_while_a_request_holds_blocks(engine):
    prompt = {**CHAT, "messages": [{"role": "user", "content": " ".join(["word"] * 40)}]}

    def hits() -> float:
        line = next(
            x for x in engine.get("/metrics").text.splitlines() if x.startswith("vllm:prefix_cache_hits_total{")
        )
        return float(line.rsplit(" ", 1)[1])

    engine.post("/v1/chat/completions", json=prompt)
    running = engine.pool.submit(engine.post, "/v1/chat/completions", json=prompt)
    wait_until(lambda: 'running{engine="0",model_name="mock-small"} 1.0' in engine.get("/metrics").text, 5, 0.02)
    assert engine.post("/reset_prefix_cache").json() == {"success": False}
    running.result(5)
    before = hits()
    engine.post("/v1/chat/completions", json=prompt)
    cached = hits()
    assert cached > before > 0, "the refused reset emptied nothing"
    engine.post("/sleep", params={"level": 1})
    engine.post("/wake_up")
    engine.post("/v1/chat/completions", json=prompt)
    assert hits() == cached, "the sleep emptied the prefix cache"


@pytest.mark.parametrize("engine", [("--token-delay-ms", "100")], indirect=True)
def test_a_sleep_aborts_the_stream_in_flight_as_vllm_does(engine):
    body = {**CHAT, "stream": True, "messages": [{"role": "user", "content": "one two three four five six"}]}
    stream = engine.pool.submit(engine.post, "/v1/chat/completions", json=body)
    wait_until(lambda: 'running{engine="0",model_name="mock-small"} 1.0' in engine.get("/metrics").text, 5, 0.02)
    engine.post("/sleep")
    events = sse_events(stream.result(5))
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"


@pytest.mark.parametrize("engine", [("--token-delay-ms", "100")], indirect=True)
def test_a_sleep_with_mode_wait_lets_the_stream_in_flight_finish_first(engine):
    body = {**CHAT, "stream": True, "messages": [{"role": "user", "content": "one two three four five six"}]}
    stream = engine.pool.submit(engine.post, "/v1/chat/completions", json=body)
    wait_until(lambda: 'running{engine="0",model_name="mock-small"} 1.0' in engine.get("/metrics").text, 5, 0.02)
    assert engine.post("/sleep", params={"level": 1, "mode": "wait"}).json() == {"status": "sleeping", "level": 1}
    # Finished whole ("stop", where mode=abort ends it with "abort"); the client may still be reading its last
    # bytes when the sleep answers, so wait for it rather than asserting it is already done.
    events = sse_events(stream.result(5))
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert engine.get("/is_sleeping").json() == {"is_sleeping": True}


def test_bad_sleep_levels_are_refused_naming_the_level(engine):
    refused = engine.post("/sleep", params={"level": "3"})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "sleep level must be 1 or 2, got '3'"
    assert refused.json()["error"]["param"] == "level"
    keep = engine.post("/sleep", params={"mode": "keep"})
    assert (keep.status_code, keep.json()["error"]["param"]) == (400, "mode")
    no_method = engine.post("/collective_rpc", json={})
    assert no_method.status_code == 400 and no_method.json()["error"]["param"] == "method"
    assert engine.get("/is_sleeping").json() == {"is_sleeping": False}


def test_without_vllms_development_mode_there_are_no_sleep_routes():
    proc, base = launch(dev_mode=False)
    try:
        assert httpx.post(base + "/sleep", timeout=5, trust_env=False).status_code == 404
        assert httpx.get(base + "/is_sleeping", timeout=5, trust_env=False).status_code == 404
    finally:
        proc.terminate()
        proc.wait(5)


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--load-seconds", "-1"], "a time must be from 0 to 3600 seconds, got -1"),
        (["--wake-seconds", "soon"], "a time must be a number of seconds, got 'soon'"),
    ],
)
def test_bad_times_exit_non_zero_naming_the_problem(argv, problem):
    result = subprocess.run(
        [sys.executable, "-m", "mockengine", "--port", "8000", "--model", "m", *argv],
        cwd=PROJECT, capture_output=True, text=True, timeout=10,
    )  # fmt: skip
    assert result.returncode != 0 and problem in result.stderr
