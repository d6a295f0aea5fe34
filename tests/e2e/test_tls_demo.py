"""End to end: `up --demo` serving its control plane over TLS; the demo agents connect over wss://."""

import ssl

import httpx
import pytest
from openai import OpenAI

from agentlink.tests.pki import TestCA
from conftest import engine_port_range, wait_until
from tests.e2e.demo_stack import API_KEY, ctl_status, demo_stack

pytestmark = pytest.mark.e2e


def test_up_serves_the_control_plane_over_tls_and_its_agents_use_wss(tmp_path):
    ca = TestCA(tmp_path / "pki")
    server = ca.issue("control-plane", server=True)
    env = {
        "LLMGW_TLS_CERT_FILE": str(server.cert),
        "LLMGW_TLS_KEY_FILE": str(server.key),
        "LLMGW_AGENT_CA_FILE": str(ca.bundle),
        "LLMGW_ENGINE_PORT_RANGE": engine_port_range(3),
    }
    with demo_stack(tmp_path, env=env) as stack:
        assert f"https://127.0.0.1:{stack['port']}/admin/" in stack["log"].read_text()
        wait_until(lambda: ctl_status(stack["env"])["nodes"]["ready"] == 3, 30, 0.5, describe=stack["log"].read_text)
        # The control plane answers HTTPS with the certificate the CA vouches for, and not plain HTTP.
        assert (
            httpx.get(
                f"https://127.0.0.1:{stack['port']}/metrics", verify=ssl.create_default_context(cafile=str(ca.bundle))
            ).status_code
            == 200
        )
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{stack['port']}/metrics", timeout=5)
        client = OpenAI(base_url=stack["router"] + "/v1", api_key=API_KEY, timeout=90, max_retries=0)
        reply = client.chat.completions.create(model="llama3", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content.startswith("mock reply")
