"""The bundled mock engine, run as a real subprocess and spoken to over HTTP on 127.0.0.1."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import free_port, wait_until

PROJECT = Path(__file__).resolve().parents[2]
MODEL = "mock-small"


def start_engine(*extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mockengine", "--port", str(port), "--model", MODEL, *extra],
        cwd=PROJECT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=0.5).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"mock engine did not start: {proc.stdout.read().decode()}")


@pytest.fixture(scope="module")
def engine():
    proc, base = start_engine()
    with httpx.Client(base_url=base, timeout=5, trust_env=False) as client:
        yield client
    proc.terminate()
    proc.wait(5)


def metrics(client) -> dict[str, float]:
    values = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            name, labels = name_labels.split("{", 1)
            if name == "vllm:engine_sleep_state":  # one sample per state: mockengine/tests/test_sleep.py
                continue
            assert labels == f'engine="0",model_name="{MODEL}"}}'
            values[name] = float(value)
    return values


def sse_events(response) -> list:
    events = []
    for block in response.text.split("\n\n"):
        if block:
            assert block.startswith("data: ")
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_chat_completion_names_the_model_and_echoes_the_user(engine):
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
    }
    reply = engine.post("/v1/chat/completions", json=body).json()
    assert reply["object"] == "chat.completion" and reply["model"] == MODEL
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": f"mock reply from {MODEL}: hello there"}
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}


def test_chat_completion_stops_at_max_tokens(engine):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "a b c"}]}
    choice = engine.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["content"] == "mock reply" and choice["finish_reason"] == "length"


def test_streamed_chat_sends_tokens_then_usage_then_done(engine):
    body = {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "stream this please"}],
    }
    response = engine.post("/v1/chat/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert text == f"mock reply from {MODEL}: stream this please"
    assert events[-3]["choices"][0]["finish_reason"] == "stop"


def test_streamed_chat_without_include_usage_has_no_usage_chunk(engine):
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    events = sse_events(engine.post("/v1/chat/completions", json=body))
    assert events[-1] == "[DONE]"
    assert all(e["choices"] and "usage" not in e for e in events[:-1])


def test_text_completion(engine):
    reply = engine.post("/v1/completions", json={"model": MODEL, "prompt": "once upon a time"}).json()
    assert reply["object"] == "text_completion"
    assert reply["choices"][0]["text"] == f"mock reply from {MODEL}: once upon a time"
    assert reply["usage"]["prompt_tokens"] == 4


def test_streamed_text_completion_ends_with_usage_and_done(engine):
    body = {"model": MODEL, "prompt": "x y", "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(engine.post("/v1/completions", json=body))
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 6
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == f"mock reply from {MODEL}: x y"


def test_embeddings_are_deterministic_unit_vectors_for_string_or_list(engine):
    one = engine.post("/v1/embeddings", json={"model": MODEL, "input": "alpha"}).json()
    many = engine.post("/v1/embeddings", json={"model": MODEL, "input": ["alpha", "beta"]}).json()
    assert [d["index"] for d in many["data"]] == [0, 1]
    assert one["data"][0]["embedding"] == many["data"][0]["embedding"]
    assert many["data"][0]["embedding"] != many["data"][1]["embedding"]
    vector = one["data"][0]["embedding"]
    assert len(vector) == 16 and abs(sum(v * v for v in vector) - 1.0) < 1e-3
    assert many["usage"] == {"prompt_tokens": 2, "total_tokens": 2}


def test_models_lists_the_served_model(engine):
    assert [m["id"] for m in engine.get("/v1/models").json()["data"]] == [MODEL]


def test_metrics_count_prompt_and_generation_tokens(engine):
    before = metrics(engine)
    engine.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "one two three"}]}
    )
    after = metrics(engine)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 3
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 7
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert 0 <= after["vllm:kv_cache_usage_perc"] <= 1


def test_another_model_is_404_in_openai_error_shape(engine):
    response = engine.post(
        "/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}
    )
    assert response.status_code == 404
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "gpt-4" in error["message"] and error["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("path", "content", "problem"),
    [
        ("/v1/chat/completions", b"{not json", "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", "JSON object"),
        ("/v1/chat/completions", json.dumps({"messages": []}).encode(), "model"),
        ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hi"}).encode(), "messages"),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": 5}).encode(), "prompt"),
        ("/v1/embeddings", json.dumps({"model": MODEL, "input": []}).encode(), "input"),
    ],
)
def test_malformed_body_is_400_in_openai_error_shape(engine, path, content, problem):
    response = engine.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and problem in error["message"]


def test_running_count_and_token_delay_are_visible_while_a_stream_is_in_flight():
    proc, base = start_engine("--token-delay-ms", "40")
    try:
        with httpx.Client(base_url=base, timeout=5, trust_env=False) as client:
            body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "a b c d e f"}]}
            started = time.monotonic()
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = response.iter_lines()
                next(lines)
                assert metrics(client)["vllm:num_requests_running"] == 1
                assert [line for line in lines if line][-1] == "data: [DONE]"
            # 10 tokens at 40 ms each.
            assert time.monotonic() - started >= 0.4
            assert metrics(client)["vllm:num_requests_running"] == 0
    finally:
        proc.terminate()
        proc.wait(5)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_engine_exits_cleanly_on_sigterm_and_sigint(sig):
    proc, _ = start_engine()
    proc.send_signal(sig)
    assert proc.wait(5) == 0


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--model", "m"], "--port"),
        (["--port", "70000", "--model", "m"], "port 70000 is outside 1-65535"),
        (["--port", "x", "--model", "m"], "port 'x' is not a number"),
        (["--port", "8000", "--model", ""], "model name must not be empty"),
        (["--port", "8000", "--model", "m", "--token-delay-ms", "-1"], "token delay"),
    ],
)
def test_bad_arguments_exit_non_zero_with_a_clear_message(argv, problem):
    result = subprocess.run(
        [sys.executable, "-m", "mockengine", *argv], cwd=PROJECT, capture_output=True, text=True, timeout=10
    )
    assert result.returncode != 0 and problem in result.stderr


def test_port_already_taken_exits_non_zero_saying_so():
    proc, base = start_engine()
    try:
        port = base.rsplit(":", 1)[1]
        result = subprocess.run(
            [sys.executable, "-m", "mockengine", "--port", port, "--model", "m"],
            cwd=PROJECT, capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        assert result.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in result.stderr
    finally:
        proc.terminate()
        proc.wait(5)


def test_health_is_held_back_while_the_hold_file_exists(tmp_path):
    hold = tmp_path / "hold"
    hold.touch()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mockengine", "--port", str(port), "--model", MODEL],
        cwd=PROJECT,
        env={**os.environ, "LLMGW_MOCK_HOLD_FILE": str(hold)},
        stdout=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/health"

        def status():
            try:
                return httpx.get(url, timeout=0.5).status_code
            except httpx.HTTPError:
                return None

        wait_until(lambda: status() is not None, 5, 0.05)
        assert status() == 503
        hold.unlink()
        assert status() == 200
    finally:
        proc.terminate()
        proc.wait(5)
