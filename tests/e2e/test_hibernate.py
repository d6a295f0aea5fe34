"""End to end: a swap on `up --demo` — the idle model sleeps instead of stopping, and wakes for its next request.

Three models that each want a whole H100 node share the demo's two. The
third one's request puts the least recently used to sleep (its engine process
is kept, its GPUs given up); the sleeper's next request is held while the
leader puts the now idle newcomer to sleep on those GPUs and wakes it: the
same replica, the same engine process, no cold start. The mock engines hold
requests while asleep, as vLLM's do, so a request routed too early would hang:
every request here is answered.
"""

import time

import httpx
import pytest
from openai import OpenAI

from conftest import wait_until
from tests.e2e.demo_stack import API_KEY, QUICK_EVICTION, catalog_stack, chat, ctl_status, engine_pids

pytestmark = pytest.mark.e2e

CATALOG = """
models:
  - name: alpha
    source: org/alpha
    profiles:
      - {engine: mock, gpu_class: H100-80GB, gpus_per_node: 8, idle_timeout_seconds: 0}
  - name: beta
    source: org/beta
    profiles:
      - {engine: mock, gpu_class: H100-80GB, gpus_per_node: 8, idle_timeout_seconds: 0}
  - name: gamma
    source: org/gamma
    profiles:
      - {engine: mock, gpu_class: H100-80GB, gpus_per_node: 8, idle_timeout_seconds: 0}
"""


@pytest.fixture
def swapping(tmp_path):
    with catalog_stack(tmp_path, CATALOG, QUICK_EVICTION) as stack:
        yield stack


def replica_of(status, model):
    (replica,) = [r for r in status["replica_list"] if r["model"] == model]
    return replica


def test_an_evicted_model_sleeps_and_its_next_request_wakes_the_same_replica(swapping, tmp_path):
    client = OpenAI(base_url=swapping["router"] + "/v1", api_key=API_KEY, timeout=90, max_retries=0)
    assert "alpha" in chat(client, "alpha")
    assert "beta" in chat(client, "beta")
    before = ctl_status(swapping["env"])
    alpha = replica_of(before, "alpha")
    engines = engine_pids(tmp_path)
    assert len(engines) == 2
    time.sleep(2.5)  # both idle past the eviction threshold; alpha used longest ago

    assert "gamma" in chat(client, "gamma")
    status = ctl_status(swapping["env"])
    assert replica_of(status, "alpha")["state"] == "sleeping"
    assert replica_of(status, "gamma")["nodes"] == alpha["nodes"]  # stacked on the sleeper's GPUs
    assert engines <= engine_pids(tmp_path)  # alpha's engine was kept: put to sleep, not stopped

    time.sleep(2.5)  # gamma idle past the threshold and resident long enough to be swapped out
    assert "alpha" in chat(client, "alpha")
    status = ctl_status(swapping["env"])
    woken = replica_of(status, "alpha")
    assert (woken["id"], woken["state"], woken["nodes"]) == (alpha["id"], "ready", alpha["nodes"])
    assert replica_of(status, "gamma")["state"] == "sleeping"
    assert len(engine_pids(tmp_path)) == 3  # no engine started for alpha's second request
    wait_until(lambda: "waking replicas" in swapping["log"].read_text(), 10, 0.2)


def test_a_model_asked_for_before_idleness_is_known_is_held_until_eviction_may_act(tmp_path):
    """Just after start-up usage is unknown for a router mark's lifetime (3 flushes: 9 s here), and the stamps of
    alpha and beta may not be collected yet: gamma's request is held, not refused, and answered once it is known."""
    env = {**QUICK_EVICTION, "LLMGW_USAGE_FLUSH_SECONDS": "3"}
    with catalog_stack(tmp_path, CATALOG, env) as stack:
        client = OpenAI(base_url=stack["router"] + "/v1", api_key=API_KEY, timeout=90, max_retries=0)
        assert "alpha" in chat(client, "alpha")
        assert "beta" in chat(client, "beta")
        time.sleep(1.5)  # idle and resident past the thresholds, but usage not known yet

        assert "gamma" in chat(client, "gamma")
        status = ctl_status(stack["env"])
        assert replica_of(status, "alpha")["state"] == "sleeping"
        held = httpx.get(stack["router"] + "/metrics", timeout=5).text
        assert 'llmgw_router_hold_seconds_count{model="gamma",reason="making_room"} 1.0' in held, held
