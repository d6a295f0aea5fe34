"""End to end: draining a node on `up --demo` is make-before-break, and the drain waits for a slow stream.

A one-replica model runs on one of the demo's two H100 nodes with a slow mock
engine. While a stream is in flight on it, the node is drained through the
REST API: the replacement starts on the other H100 node and answers; only
then is the old replica unpublished and drained, and its engine stops after
the stream has finished whole.
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
         idle_timeout_seconds: 0, engine_args: ["--token-delay-ms", "600"]}
"""


def test_node_drain_replaces_first_and_lets_the_stream_in_flight_finish(tmp_path):
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(CATALOG)
    env = {"LLMGW_HEARTBEAT_SECONDS": "0.5", "LLMGW_ENGINE_PORT_RANGE": engine_port_range(2)}
    with demo_stack(tmp_path, "--catalog", str(catalog), env=env) as stack:
        client = OpenAI(base_url=stack["router"] + "/v1", api_key=API_KEY, timeout=90, max_retries=0)
        first = client.chat.completions.create(model="slow", messages=[{"role": "user", "content": "hi"}])
        assert first.choices[0].message.content.startswith("mock reply from slow")
        (old,) = [r for r in ctl_status(stack["env"])["replica_list"] if r["model"] == "slow"]
        (node,) = old["nodes"]

        streamed: list[str] = []
        finished: list[float] = []

        def stream():
            chunks = client.chat.completions.create(
                model="slow", messages=[{"role": "user", "content": "word " * 12}], stream=True
            )
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

        streaming.join(60)
        assert not streaming.is_alive()
        # The stream finished whole: the reply header and the 12 words echoed (the mock echoes 12), 0.6 s a token.
        assert "".join(streamed) == "mock reply from slow:" + " word" * 12
        # The old engine stopped because it drained (no running requests), not because the drain timed out.
        stopped = re.compile(r"shard \d+ on " + re.escape(node) + r": stopped \(drained: no running requests")
        wait_until(lambda: stopped.search(log.read_text()), 15, 0.1, describe=log.read_text)
        # New requests go to the replacement.
        reply = client.chat.completions.create(model="slow", messages=[{"role": "user", "content": "again"}])
        assert reply.choices[0].message.content.startswith("mock reply from slow")
