"""End to end: draining a node on `up --demo` is make-before-break, and a stream longer than the drain moves.

A one-replica model runs on one of the demo's two H100 nodes with a slow mock
engine in greedy mode. While a stream is in flight on it, the node is drained
through the REST API: the replacement starts on the other H100 node and
answers; only then is the old replica unpublished and drained. The stream
outlasts the drain's timeout (3 s), so the router moves it to the replacement
two seconds before that timeout: the client gets the whole answer, token for
token, and the old engine, left idle, stops as drained, not timed out.
"""

import re
import subprocess
import sys
import threading
import time

import httpx
import pytest
from openai import OpenAI

from conftest import engine_port_range, wait_until
from tests.e2e.demo_stack import API_KEY, ROOT, ctl_status, demo_stack

pytestmark = pytest.mark.e2e

CATALOG = """
models:
  - name: slow
    source: org/slow
    profiles:
      - {engine: mock, gpu_class: H100-80GB, gpus_per_node: 8, min_replicas: 1, max_replicas: 1,
         idle_timeout_seconds: 0, engine_args: ["--token-delay-ms", "500", "--greedy"]}
"""


MESSAGES = [{"role": "user", "content": "tell me a long story"}]
TOKENS = 24  # 12 s at 0.5 s a token: longer than the replacement's start and the 3 s drain together


def test_node_drain_replaces_first_and_moves_the_stream_that_outlasts_the_drain(tmp_path):
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(CATALOG)
    env = {
        "LLMGW_HEARTBEAT_SECONDS": "0.5",
        "LLMGW_ENGINE_PORT_RANGE": engine_port_range(2),
        "LLMGW_DRAIN_TIMEOUT_SECONDS": "3",
    }
    with demo_stack(tmp_path, "--catalog", str(catalog), env=env) as stack:
        client = OpenAI(base_url=stack["router"] + "/v1", api_key=API_KEY, timeout=90, max_retries=0)
        first = client.chat.completions.create(model="slow", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert first.choices[0].finish_reason == "length"
        (old,) = [r for r in ctl_status(stack["env"])["replica_list"] if r["model"] == "slow"]
        (node,) = old["nodes"]

        streamed: list[str] = []
        finished: list[float] = []

        def stream():
            chunks = client.chat.completions.create(model="slow", messages=MESSAGES, max_tokens=TOKENS, stream=True)
            streamed.extend(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finished.append(time.monotonic())

        streaming = threading.Thread(target=stream)
        streaming.start()
        time.sleep(1.0)  # the stream is under way on the old replica

        token = subprocess.run(
            [sys.executable, "manage.py", "create_api_token", "admin"], cwd=ROOT, env=stack["env"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout.strip()  # fmt: skip
        response = httpx.post(
            f"http://127.0.0.1:{stack['port']}/api/v1/nodes/{node}/drain",
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        assert response.json()["replicas_stopped"] == 1

        # Make-before-break: the old replica is drained only once its replacement is ready elsewhere.
        log = stack["log"]
        wait_until(lambda: f"draining replica {old['id']}: replaced by replica" in log.read_text(), 30, 0.1,
                   describe=log.read_text)  # fmt: skip
        assert streaming.is_alive(), "the stream should still be in flight when its replica starts draining"
        new = [r for r in ctl_status(stack["env"])["replica_list"] if r["model"] == "slow" and r["id"] != old["id"]]
        assert new and new[0]["state"] == "ready" and new[0]["nodes"] != [node]

        # Past the drain's timeout less two seconds, the router moves the stream to the replacement: the old
        # engine, left idle, stopped because it drained (no running requests), not because the drain timed out.
        stopped = re.compile(r"shard \d+ on " + re.escape(node) + r": stopped \(drained: no running requests")
        wait_until(lambda: stopped.search(log.read_text()), 15, 0.1, describe=log.read_text)
        assert streaming.is_alive(), "the stream should have moved, not waited for its old engine to finish it"
        streaming.join(60)
        assert not streaming.is_alive()
        # The stream finished whole, token for token what the replacement answers the same request with.
        again = client.chat.completions.create(model="slow", messages=MESSAGES, max_tokens=TOKENS)
        assert "".join(streamed) == again.choices[0].message.content
        moved = 'llmgw_router_stream_continuations_total{model="slow",outcome="continued",reason="replica_leaving"} 1.0'
        assert moved in httpx.get(stack["router"] + "/metrics", timeout=10).text
