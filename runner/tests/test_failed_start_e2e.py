"""End to end: an engine that exits during its start fails the waiting request at once, through the
router, with the engine's own last error line (503 `model_failed`), and the agent's log shows the
start line shell-quoted and the engine's output under its shard and model."""

import time

import httpx
import pytest

from tests.e2e.demo_stack import API_KEY, demo_stack

pytestmark = pytest.mark.e2e

CATALOG = """\
models:
- name: broken-chat
  source: org/broken chat
  aliases: [broken]
  profiles:
  - {engine: mock, gpu_class: L40S-48GB, max_replicas: 1, engine_args: ["--no-such-flag", "two words"]}
"""


def test_an_engine_that_exits_at_start_fails_the_request_at_once_with_its_words(tmp_path):
    (tmp_path / "broken.yaml").write_text(CATALOG)
    with demo_stack(tmp_path, "--catalog", str(tmp_path / "broken.yaml")) as stack:
        started = time.monotonic()
        answer = httpx.post(
            f"{stack['router']}/v1/chat/completions",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={"model": "broken", "messages": [{"role": "user", "content": "Hello!"}]},
            timeout=60,
        )
        waited = time.monotonic() - started
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert error["code"] == "model_failed" and error["type"] == "server_error"
        assert "unrecognized arguments: --no-such-flag two words" in error["message"]
        assert "engine exited with code 2" in error["message"]
        assert waited < 20, f"answered after {waited:.1f} s, not at once (the activation wait is 120 s)"
        log = stack["log"].read_text()
        assert "--no-such-flag 'two words'" in log  # the start line, shell-quoted
        assert "(broken-chat rank 0): " in log and "unrecognized arguments" in log
