"""End to end: more models than cards on `up --demo` with a catalog file.

Two 8-GPU models fill the demo's two H100 nodes. A model whose first profile
wants a whole H100 node falls back to its L40S profile on gpu-c. Then a third
8-GPU model is asked for while a stream is in flight on one of the two: the
other one, idle and not allowed to sleep (sleep_level 0; tests/e2e/test_hibernate.py has the
sleeping kind), is evicted (drained, stopped), the newcomer is placed on its
node and answers, and the stream finishes whole.
"""

import threading
import time

import pytest
from openai import OpenAI

from conftest import wait_until
from tests.e2e.demo_stack import API_KEY, QUICK_EVICTION, catalog_stack, chat, ctl_status

pytestmark = pytest.mark.e2e

CATALOG = """
models:
  - name: alpha
    source: org/alpha
    profiles:
      - {engine: mock, gpu_class: H100-80GB, gpus_per_node: 8, idle_timeout_seconds: 0,
         engine_args: ["--token-delay-ms", "800"]}
  - name: beta
    source: org/beta
    profiles:
      - {engine: mock, gpu_class: H100-80GB, gpus_per_node: 8, idle_timeout_seconds: 0, sleep_level: 0}
  - name: gamma
    source: org/gamma
    profiles:
      - {engine: mock, gpu_class: H100-80GB, gpus_per_node: 8, idle_timeout_seconds: 0}
  - name: flexible
    source: org/flexible
    profiles:
      - {engine: mock, gpu_class: H100-80GB, gpus_per_node: 8, idle_timeout_seconds: 0}
      - {engine: mock, gpu_class: L40S-48GB, gpus_per_node: 2, idle_timeout_seconds: 0}
"""


@pytest.fixture
def pressure(tmp_path):
    with catalog_stack(tmp_path, CATALOG, QUICK_EVICTION) as stack:
        yield stack


def replicas_of(status, model):
    return [r for r in status["replica_list"] if r["model"] == model]


def test_the_least_recently_used_model_makes_room_and_a_fallback_profile_serves(pressure):
    client = OpenAI(base_url=pressure["router"] + "/v1", api_key=API_KEY, timeout=90, max_retries=0)
    assert "alpha" in chat(client, "alpha")
    assert "beta" in chat(client, "beta")
    status = ctl_status(pressure["env"])
    held = {r["model"]: r["nodes"] for r in status["replica_list"]}
    assert sorted(held["alpha"] + held["beta"]) == ["gpu-a", "gpu-b"]

    # The H100 nodes are full: the fallback profile serves from the L40S node.
    assert "flexible" in chat(client, "flexible")
    assert replicas_of(ctl_status(pressure["env"]), "flexible")[0]["nodes"] == ["gpu-c"]

    # A long stream on alpha is in flight while gamma is asked for; beta is idle.
    streamed: list[str] = []

    def stream_alpha():
        chunks = client.chat.completions.create(
            model="alpha", messages=[{"role": "user", "content": "word " * 12}], stream=True
        )
        streamed.extend(c.choices[0].delta.content or "" for c in chunks if c.choices)

    streaming = threading.Thread(target=stream_alpha)
    streaming.start()
    time.sleep(2.5)  # beta has been idle longer than the eviction threshold; alpha is busy

    assert "gamma" in chat(client, "gamma")
    assert streaming.is_alive()  # the stream was in flight through the whole eviction

    status = ctl_status(pressure["env"])
    assert replicas_of(status, "beta") == []
    assert replicas_of(status, "gamma")[0]["nodes"] == held["beta"]
    assert replicas_of(status, "alpha")[0]["state"] == "ready"
    streaming.join(60)
    assert not streaming.is_alive()
    # The stream finished whole: "mock reply from alpha:" and the 12 words echoed, 0.8 s a token.
    assert "".join(streamed) == "mock reply from alpha:" + " word" * 12

    wait_until(lambda: "evicted for gamma" in pressure["log"].read_text(), 10, 0.2)
