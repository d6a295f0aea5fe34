"""End to end: `manage.py up --demo --catalog FILE` as a real process serves the file's models, not the bundled ones."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import engine_port_range, free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-llmgw-e2e-catalog-key-0123456789"
CATALOG = """\
models:
- name: tiny-chat
  source: org/tiny-chat
  enabled: true
  aliases: [tiny]
  profiles:
  - {engine: mock, gpu_class: L40S-48GB, gpus_per_node: 2, max_replicas: 1}
"""


def test_up_demo_with_a_catalog_file_serves_that_catalog(tmp_path):
    (tmp_path / "my.yaml").write_text(CATALOG)
    port, router_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")} | {
        "LLMGW_HOME": str(tmp_path),
        "LLMGW_DEMO_API_KEY": API_KEY,
        "LLMGW_PORT": str(port),
        "LLMGW_ROUTER_PORT": str(router_port),
        "LLMGW_TICK_SECONDS": "0.5",
        "LLMGW_ENGINE_PORT_RANGE": engine_port_range(5),
        "PYTHONUNBUFFERED": "1",
    }
    log_path = tmp_path / "up.log"
    base = f"http://127.0.0.1:{router_port}"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "up", "--demo", "--catalog", str(tmp_path / "my.yaml")],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 60
            while "API key" not in log_path.read_text():
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "up did not start within 60 s:\n" + log_path.read_text()
                time.sleep(0.2)
            banner = log_path.read_text()
            assert "catalog               1 created" in banner
            assert '"model": "tiny"' in banner  # the curl line names the file's first model

            models = httpx.get(f"{base}/v1/models", headers=headers, timeout=5).json()
            assert sorted(m["id"] for m in models["data"]) == ["tiny", "tiny-chat"]
            answer = httpx.post(
                f"{base}/v1/chat/completions",
                headers=headers,
                json={"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}]},
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"]
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 0, log_path.read_text()
