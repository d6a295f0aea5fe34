"""The mock engine's LoRA adapters as vLLM serves them (mockengine/lora.py), run as a real subprocess and spoken to
over HTTP on 127.0.0.1: the load and unload routes, their errors, /v1/models, requests by adapter name, the
load time and vllm:lora_requests_info."""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import free_port, wait_until
from mockengine.tests.test_server import MODEL, PROJECT

LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"


def launch(*extra: str, runtime_updates: str = "true") -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": runtime_updates}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mockengine", "--port", str(port), "--model", MODEL, *extra],
        cwd=PROJECT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def answers():
        try:
            return httpx.get(base + "/health", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(answers, 5, 0.05)
    return proc, base


@pytest.fixture
def engine(request):
    extra, runtime_updates = getattr(request, "param", (("--enable-lora", "--max-loras", "2"), "true"))
    proc, base = launch(*extra, runtime_updates=runtime_updates)
    with httpx.Client(base_url=base, timeout=10, trust_env=False) as client:
        yield client
    proc.terminate()
    proc.wait(5)


def load(client, name: str, path: str = "org/adapter") -> httpx.Response:
    return client.post(LOAD, json={"lora_name": name, "lora_path": path})


def chat(client, model: str, **extra) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                                                     **extra})  # fmt: skip


def lora_info(client) -> list[dict[str, str]]:
    samples = []
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("vllm:lora_requests_info{"):
            labels = line.split("{", 1)[1].rsplit("}", 1)[0]
            samples.append(dict(part.split("=", 1) for part in labels.replace('"', "").split(",") if "=" in part))
    return samples


def test_a_loaded_adapter_is_listed_answers_under_its_name_and_is_gone_once_unloaded(engine, tmp_path):
    answer = load(engine, "sql", str(tmp_path))
    assert (answer.status_code, answer.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
    models = {m["id"]: m for m in engine.get("/v1/models").json()["data"]}
    assert models["sql"]["parent"] == MODEL and models["sql"]["root"] == str(tmp_path)
    assert "parent" not in models[MODEL]
    reply = chat(engine, "sql").json()
    assert reply["model"] == "sql" and reply["choices"][0]["message"]["content"].startswith("mock reply from sql:")
    streamed = engine.post("/v1/completions", json={"model": "sql", "prompt": "x", "stream": True}).text
    assert json.loads(streamed.split("\n\n")[0].removeprefix("data: "))["model"] == "sql"
    assert lora_info(engine) == [{"max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": ""}]

    answer = engine.post(UNLOAD, json={"lora_name": "sql"})
    assert (answer.status_code, answer.text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
    assert [m["id"] for m in engine.get("/v1/models").json()["data"]] == [MODEL]
    missing = chat(engine, "sql")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"].startswith("The model `sql` does not exist")
    again = engine.post(UNLOAD, json={"lora_name": "sql"})
    assert again.status_code == 404
    assert again.json()["error"] == {"message": "The lora adapter 'sql' cannot be found.", "type": "NotFoundError",
                                     "param": None, "code": 404}  # fmt: skip


def test_vllms_refusals_a_name_loaded_twice_full_slots_a_missing_folder_and_empty_fields(engine, tmp_path):
    assert load(engine, "a").status_code == 200  # a hub id: taken as found
    twice = load(engine, "a")
    assert twice.status_code == 400 and twice.json()["error"]["type"] == "InvalidUserInput"
    assert twice.json()["error"]["message"].startswith("The lora adapter 'a' has already been loaded.")
    gone = load(engine, "b", str(tmp_path / "nowhere"))
    assert gone.status_code == 404
    assert gone.json()["error"]["message"] == f"Loading lora b failed: No adapter found for {tmp_path / 'nowhere'}"
    assert load(engine, "b").status_code == 200
    full = load(engine, "c")
    assert full.status_code == 500
    assert full.json()["error"]["message"] == (
        "Cannot load LoRA adapter 'c': all 2 --max-loras slots hold adapters (a, b); unload one first"
    )
    empty = engine.post(LOAD, json={"lora_name": "d", "lora_path": ""})
    assert (empty.status_code, empty.json()["error"]["message"]) == (
        400, "Both 'lora_name' and 'lora_path' must be provided."
    )  # fmt: skip
    wrong = engine.post(LOAD, json={"lora_name": 5, "lora_path": "x"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "lora_name"
    assert engine.post(LOAD, content=b"not json").status_code == 400
    assert engine.post(UNLOAD, json={}).json()["error"]["message"] == (
        "'lora_name' needs to be provided to unload a LoRA adapter."
    )


@pytest.mark.parametrize("engine", [(("--enable-lora", "--max-lora-rank", "8"), "true")], indirect=True)
def test_an_adapter_of_a_rank_above_the_largest_is_refused_and_one_slot_is_vllms_default(engine, tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 16, "peft_type": "LORA"}))
    big = load(engine, "big", str(tmp_path))
    assert (big.status_code, big.json()["error"]["message"]) == (400, "LoRA rank 16 is greater than max_lora_rank 8.")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    assert load(engine, "fits", str(tmp_path)).status_code == 200
    assert load(engine, "second").status_code == 500  # one slot, vLLM's default
    assert lora_info(engine)[0]["max_lora"] == "1"


@pytest.mark.parametrize(
    "engine", [(("--enable-lora",), "0"), (("--enable-lora",), "false")], indirect=True, ids=["0", "false"]
)
def test_without_runtime_updating_the_routes_do_not_exist(engine):
    assert load(engine, "a").status_code == 404
    assert engine.post(UNLOAD, json={"lora_name": "a"}).status_code == 404


@pytest.mark.parametrize("engine", [((), "1")], indirect=True)
def test_without_enable_lora_a_load_fails_as_vllms_and_there_is_no_lora_gauge(engine):
    answer = load(engine, "a")
    assert answer.status_code == 500
    assert answer.json()["error"] == {"message": "LoRA is not enabled.", "type": "InternalServerError",
                                      "param": None, "code": 500}  # fmt: skip
    assert lora_info(engine) == []
    assert chat(engine, "a").status_code == 404


@pytest.mark.parametrize(
    "engine", [(("--enable-lora", "--lora-load-seconds", "0.6", "--token-delay-ms", "150"), "true")], indirect=True
)
def test_a_load_takes_its_time_holds_its_slot_meanwhile_and_requests_show_in_the_gauge(engine):
    with ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        loading = pool.submit(load, engine, "slow")
        wait_until(lambda: time.monotonic() - started > 0.2, 1, 0.05)
        # The one slot is taken by the load under way.
        assert load(engine, "other").status_code == 500
        assert loading.result(5).status_code == 200
        assert time.monotonic() - started >= 0.6
        # Running for 3 s (20 tokens at 150 ms): a loaded machine may answer the gauge's reads late.
        running = pool.submit(chat, engine, "slow", max_tokens=20)
        wait_until(lambda: lora_info(engine)[0]["running_lora_adapters"] == "slow", 10, 0.05)
        assert running.result(15).json()["model"] == "slow"
    assert lora_info(engine)[0]["running_lora_adapters"] == ""
