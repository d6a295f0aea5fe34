"""End to end, real processes: a model whose weights no node holds is staged from the (mock) hub while its node
serves another model's requests; ctl_status shows the stage's progress as it goes; the hub serves each byte
once; the replica starts only once its weights are all there, and answers."""

import threading

import httpx
import pytest

from conftest import wait_until
from mockhub.repos import make_safetensors_repo
from tests.e2e.staging_fleet import staging_fleet

pytestmark = pytest.mark.e2e

MB = 10**6
CATALOG = """models:
- name: big
  source: org/big
  enabled: true
  aliases: []
  profiles:
  - {engine: mock, gpu_class: H100-80GB, gpus_per_node: 1, min_replicas: 0, max_replicas: 1}
- name: small
  source: org/small
  enabled: true
  aliases: []
  profiles:
  - {engine: mock, gpu_class: H100-80GB, gpus_per_node: 1, min_replicas: 1, max_replicas: 1}
"""


def test_a_model_stages_holding_no_gpu_while_its_node_serves_another_and_its_progress_shows(tmp_path):
    repos = tmp_path / "repos"
    big = make_safetensors_repo(repos, "org/big", 24 * MB, files=3)
    make_safetensors_repo(repos, "org/small", 64 * 1024, files=1)
    with staging_fleet(tmp_path, repos, ["n1"], hub_rate=4 * MB, gpus="2xH100-80GB") as fleet:
        fleet.apply(CATALOG)
        headers = {"Authorization": f"Bearer {fleet.key}"}

        def ask(model: str, timeout: float = 120) -> httpx.Response:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            return httpx.post(f"{fleet.router}/v1/chat/completions", json=body, headers=headers, timeout=timeout)

        wait_until(lambda: ask("small").status_code == 200, 90, 0.5, describe=fleet.log)
        answered: dict = {}
        waiting = threading.Thread(target=lambda: answered.setdefault("big", ask("big")))
        waiting.start()  # a cold start: the router holds it while big's weights are staged

        def staging_now():
            stages = [s for s in fleet.status()["staging"] if s["source"] == "org/big" and s["state"] == "fetching"]
            return stages[0] if stages and 0 < stages[0]["bytes_done"] < stages[0]["bytes_total"] else None

        stage = wait_until(staging_now, 60, 0.2, describe=fleet.log)
        assert stage["node"] == "n1" and stage["bytes_per_second"] > 0
        text = fleet.manage("ctl_status")
        assert "Staging weights" in text and "org/big" in text and "fetching" in text
        # Staging holds no GPU: the node's other model answers meanwhile, and big has no shard yet.
        assert ask("small", timeout=10).status_code == 200
        replicas = [r for r in fleet.status()["replica_list"] if r["model"] == "big"]
        assert [(r["state"], r["nodes"]) for r in replicas] == [("pending", [])]

        waiting.join(120)
        assert answered["big"].status_code == 200, answered["big"].text
        served = fleet.hub_stats()["served"]
        assert sum(n for path, n in served.items() if path.startswith("org/big/")) == sum(
            p.stat().st_size for p in big.iterdir()
        )
        ended = [s for s in fleet.status()["staging"] if s["source"] == "org/big"]
        assert [s["state"] for s in ended] in ([], ["ready"])
