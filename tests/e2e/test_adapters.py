"""LoRA adapters end to end on `up --demo`: the router holds a request for an adapter no replica holds, the
leader assigns it to the base's replica, the agent loads it into the mock engine, and the request is served
under the adapter's name; a full engine unloads its least recently used adapter first, an idle one is
unloaded, and tokens are counted per adapter."""

from __future__ import annotations

import sqlite3
import time

import httpx
import pytest
from openai import OpenAI

from tests.e2e.demo_stack import API_KEY, catalog_stack

pytestmark = pytest.mark.e2e

# One slot, so a second adapter must take the first one's place; a short idle timeout for adapters (the base
# stays: it is the model's min).
CATALOG = """
models:
  - name: base
    source: org/base
    profiles:
      - engine: mock
        gpu_class: H100-80GB
        gpus_per_node: 8
        min_replicas: 1
        max_adapters: 1
        idle_timeout_seconds: 4
        engine_args: ["--lora-load-seconds", "0.3"]
    adapters:
      - {name: ft-a, source: org/ft-a}
      - {name: ft-b, source: org/ft-b, aliases: [support-bot]}
"""


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    pytest.fail(f"not within {timeout} s: {what}")


def test_adapters_are_loaded_on_demand_served_swapped_for_the_next_and_unloaded_when_idle(tmp_path):
    with catalog_stack(tmp_path, CATALOG, {"LLMGW_HEARTBEAT_SECONDS": "1"}) as stack:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        listed = httpx.get(stack["router"] + "/v1/models", headers=headers, timeout=10).json()["data"]
        parents = {m["id"]: m.get("parent") for m in listed}
        assert parents["ft-a"] == "base" and parents["support-bot"] == "base" and parents["base"] is None

        client = OpenAI(base_url=stack["router"] + "/v1", api_key=API_KEY, timeout=60, max_retries=0)
        first = client.chat.completions.create(model="ft-a", messages=[{"role": "user", "content": "hi"}])
        assert first.model == "ft-a"  # served by the engine under the adapter's name
        log = stack["log"]
        assert "loading adapter ft-a onto replica" in log.read_text()

        # An alias of the second adapter: one slot, so ft-a is unloaded first, then ft-b loaded.
        second = client.chat.completions.create(model="support-bot", messages=[{"role": "user", "content": "hi"}])
        assert second.model == "ft-b"
        text = log.read_text()
        assert "loading adapter ft-b onto replica" in text
        unloaded = text.index("unloading adapter ft-a from replica")
        assert "least recently used, for ft-b" in text[unloaded:].splitlines()[0]
        assert text.index("loading adapter ft-b") > text.index("loading adapter ft-a")

        # Unused past the base profile's idle timeout (4 s), ft-b is unloaded; the base replica stays.
        wait_for(lambda: "unloading adapter ft-b from replica" in log.read_text(), 20, "ft-b unloaded when idle")
        assert client.chat.completions.create(model="base", messages=[{"role": "user", "content": "x"}]).model

        # Tokens per key and adapter, stored by the tick from the routers' counts.
        def usage() -> dict[str, int]:
            with sqlite3.connect(tmp_path / "llmgw.sqlite3") as db:
                return dict(db.execute("select model, sum(requests) from keys_tokenusage group by model"))

        wait_for(lambda: {"ft-a", "ft-b"} <= usage().keys(), 15, "token usage stored per adapter")
        assert usage()["ft-a"] == 1 and usage()["ft-b"] == 1
