"""End to end: a key bound to a pool starts its model on the profile of that pool (the demo's L40S node, not
the H100 nodes of the model's first profile) and is served there; a key whose pools the model has no profile
in is refused at once (403 `model_not_in_pools`), not held."""

import time

import httpx
import pytest

from tests.e2e.demo_stack import catalog_stack, ctl_status
from tests.e2e.test_gateway import create_key

pytestmark = pytest.mark.e2e

CATALOG = """\
models:
- name: pooled-chat
  source: org/pooled-chat
  profiles:
  - {engine: mock, gpu_class: H100-80GB, max_replicas: 1}
  - {engine: mock, gpu_class: L40S-48GB, max_replicas: 1, pool: gold}
"""


def ask(stack, key):
    return httpx.post(
        f"{stack['router']}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "pooled-chat", "messages": [{"role": "user", "content": "Hello!"}]},
        timeout=90,
    )


def test_a_pool_bound_key_starts_its_model_in_its_pool_and_a_key_of_other_pools_is_refused_at_once(tmp_path):
    with catalog_stack(tmp_path, CATALOG) as stack:
        elsewhere = create_key(stack["env"], "silver-team", "--pools", "silver")
        started = time.monotonic()
        refused = ask(stack, elsewhere)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "model_not_in_pools"
        assert time.monotonic() - started < 10  # the activation wait is 120 s

        gold = create_key(stack["env"], "gold-team", "--pools", "gold")
        answer = ask(stack, gold)
        assert answer.status_code == 200, answer.text
        replicas = [r for r in ctl_status(stack["env"])["replica_list"] if r["model"] == "pooled-chat"]
        assert [(r["state"], r["nodes"]) for r in replicas] == [("ready", ["gpu-c"])], replicas
