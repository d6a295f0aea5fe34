"""End to end: `manage.py up --demo` as a real process, an OpenAI client, ctl_status.

A model with no replica is asked for; the router activates it, the reconciler
places it on a simulated node, the agent starts the mock engine as a real
subprocess, and the answer comes back. Then ctl_status shows its last use, and
stopping `up` (gracefully or by SIGKILL) leaves no engine running.
"""

import signal

import httpx
import pytest
from openai import OpenAI

from conftest import wait_until
from tests.e2e.demo_stack import API_KEY, ctl_status, demo_stack, engine_pids

pytestmark = pytest.mark.e2e


@pytest.fixture
def demo(tmp_path):
    with demo_stack(tmp_path) as stack:
        yield stack


def test_demo_serves_a_cold_model_and_reports_its_last_use(demo):
    banner = demo["log"].read_text()
    assert API_KEY in banner and "e2e-admin-password" in banner

    before = ctl_status(demo["env"])
    assert not any(r["model"] == "llama-3.1-8b-instruct" for r in before["replica_list"])

    client = OpenAI(base_url=demo["router"] + "/v1", api_key=API_KEY, timeout=60, max_retries=0)
    reply = client.chat.completions.create(model="llama3", messages=[{"role": "user", "content": "hello there"}])
    assert "llama-3.1-8b-instruct" in reply.choices[0].message.content
    assert reply.usage.total_tokens > 0

    chunks = list(
        client.chat.completions.create(
            model="llama-3.1-8b-instruct",
            messages=[{"role": "user", "content": "stream please"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "llama-3.1-8b-instruct" in text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0

    def used_replica():
        status = ctl_status(demo["env"])
        replicas = [r for r in status["replica_list"] if r["model"] == "llama-3.1-8b-instruct"]
        return replicas if replicas and replicas[0]["idle_known"] else None

    replicas = wait_until(used_replica, 20, 0.3, describe=lambda: ctl_status(demo["env"]))
    assert replicas[0]["state"] == "ready" and replicas[0]["idle_seconds"] >= 0

    # The control plane serves admin (with its static files) and metrics on its own port.
    control = f"http://127.0.0.1:{demo['port']}"
    assert httpx.get(f"{control}/admin/login/").status_code == 200
    assert httpx.get(f"{control}/static/admin/css/base.css").status_code == 200
    assert "llmgw_gpus" in httpx.get(f"{control}/metrics").text

    # Wrong key and unknown model are refused in OpenAI's shape.
    bad = httpx.post(f"{demo['router']}/v1/chat/completions", headers={"Authorization": "Bearer nope"}, json={})
    assert bad.status_code == 401 and "error" in bad.json()
    unknown = httpx.post(
        f"{demo['router']}/v1/chat/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": "no-such-model", "messages": []},
    )
    assert unknown.status_code == 404 and "no-such-model" in unknown.json()["error"]["message"]

    # A graceful stop takes the engines with it.
    engines = engine_pids(demo["var"])
    assert engines, "the demo should be running engine processes"
    demo["proc"].send_signal(signal.SIGINT)
    assert demo["proc"].wait(30) == 0, demo["log"].read_text()
    wait_until(lambda: not engine_pids(demo["var"]), 10, 0.3)


def test_killing_up_leaves_no_engine_running(demo):
    # bge-m3 has min_replicas=1, so an engine starts without any request.
    wait_until(lambda: engine_pids(demo["var"]), 30, 0.3, describe=demo["log"].read_text)
    demo["proc"].kill()
    demo["proc"].wait(10)
    wait_until(lambda: not engine_pids(demo["var"]), 10, 0.3)
