"""The agent link over TLS, with real handshakes: a uvicorn control plane on 127.0.0.1 serving wss:// with a
throwaway CA, and real agents. Server verification, mutual TLS (the certificate's CN must be the node's
name), and the clear failures of a wrong CA or a wrong scheme."""

import asyncio
import logging
import threading

import pytest
import uvicorn

from agent import cli
from agent.gpus.discovery import parse_fake_gpus
from agent.link import AgentRejected, AgentTLSError
from agent.options import AgentOptions
from agent.runtime import Agent
from agentlink.tests.pki import TestCA
from conftest import free_port, wait_until
from inventory.choices import NodeState
from inventory.models import Node
from inventory.services import enrol_node
from llmgw_site.asgi import application
from runner.embedded import _Server, control_plane_options

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def pki(tmp_path):
    ca = TestCA(tmp_path / "ca")
    return {
        "ca": ca,
        "server": ca.issue("control-plane", server=True),
        "gpu-a": ca.issue("gpu-a"),
        "gpu-b": ca.issue("gpu-b"),
        "other_ca": TestCA(tmp_path / "other", "other CA"),
    }


@pytest.fixture
def control_plane(settings, pki):
    """Start a TLS control plane (as `manage.py up` configures uvicorn); call with mutual=True for a client CA."""
    servers = []

    def start(mutual: bool = False, tls: bool = True) -> str:
        settings.LLMGW_TLS_CERT_FILE = str(pki["server"].cert) if tls else ""
        settings.LLMGW_TLS_KEY_FILE = str(pki["server"].key) if tls else ""
        settings.LLMGW_TLS_CLIENT_CA_FILE = str(pki["ca"].bundle) if mutual else ""
        port = free_port()
        # log_config=None: uvicorn's logging setup would take pytest's log capture off the root logger
        # (so would Django's, run when the ASGI module is first imported: it is imported with this module).
        options = control_plane_options() | {"log_config": None}
        server = _Server(uvicorn.Config(application, host="127.0.0.1", port=port, **options))
        thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
        thread.start()
        servers.append((server, thread))
        wait_until(lambda: server.started, 10, 0.02)
        return f"{'wss' if tls else 'ws'}://127.0.0.1:{port}/agent/ws"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


def agent_for(url: str, node: str, token: str, **tls) -> Agent:
    gpus = parse_fake_gpus("1xL4-24GB", node)
    return Agent(AgentOptions([url], node, token, gpus, "127.0.0.1", heartbeat_seconds=0.2, **tls))


async def says_hello(agent: Agent, node: str) -> None:
    """Run the agent until the control plane has recorded its hello, then stop it."""
    task = asyncio.create_task(agent.run())
    try:
        for _ in range(200):
            state = await asyncio.to_thread(lambda: Node.objects.get(name=node).state)
            if state == NodeState.READY or task.done():
                break
            await asyncio.sleep(0.05)
        assert not task.done(), task.exception()
        assert state == NodeState.READY
    finally:
        await agent.shutdown()
        await task


def run(coro, timeout=20):
    async def bounded():
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())


def test_agent_trusting_the_ca_connects_over_wss_and_says_hello(control_plane, pki):
    url = control_plane()
    _, token = enrol_node("gpu-a")
    run(says_hello(agent_for(url, "gpu-a", token, ca_file=str(pki["ca"].bundle)), "gpu-a"))


def test_agent_with_the_wrong_ca_is_refused_and_gives_up_with_a_clear_error(control_plane, pki, caplog):
    caplog.set_level(logging.ERROR, logger="agent.link")
    url = control_plane()
    _, token = enrol_node("gpu-a")
    agent = agent_for(url, "gpu-a", token, ca_file=str(pki["other_ca"].bundle))
    with pytest.raises(AgentTLSError, match="no control plane completed TLS with node “gpu-a”") as refused:
        run(agent.run())
    assert f"is not trusted by the CA bundle {pki['other_ca'].bundle}" in str(refused.value)
    assert f"TLS with control plane {url} failed: its certificate is not trusted" in caplog.text
    assert Node.objects.get(name="gpu-a").state == NodeState.NEW


def test_agent_command_with_the_wrong_ca_exits_non_zero_saying_why(control_plane, pki, capsys):
    url = control_plane()
    _, token = enrol_node("gpu-a")
    args = ["--control-plane", url, "--node", "gpu-a", "--token", token, "--fake-gpus", "1xL4-24GB"]
    assert cli.main([*args, "--address", "127.0.0.1", "--ca-file", str(pki["other_ca"].bundle)]) == 1
    err = capsys.readouterr().err
    # A line of its own: the log lines before it go wherever an earlier test of this process left logging.
    said = [line for line in err.splitlines() if line.startswith("python -m agent: error: ")]
    assert said and said[0].startswith("python -m agent: error: no control plane completed TLS with node “gpu-a”")
    assert "unable to get local issuer certificate" in said[0]


def test_plain_ws_to_a_tls_control_plane_fails_naming_the_likely_cause(control_plane, caplog):
    caplog.set_level(logging.WARNING, logger="agent.link")
    url = control_plane().replace("wss://", "ws://")
    _, token = enrol_node("gpu-a")

    async def scenario():
        agent = agent_for(url, "gpu-a", token)
        task = asyncio.create_task(agent.run())
        for _ in range(100):
            if "is it a wss:// address?" in caplog.text:
                break
            await asyncio.sleep(0.05)
        await agent.shutdown()
        await task

    run(scenario())
    assert f"control plane {url} did not answer the WebSocket handshake (is it a wss:// address?)" in caplog.text


def test_wss_to_a_plain_control_plane_gives_up_saying_it_does_not_speak_tls(control_plane, caplog):
    caplog.set_level(logging.ERROR, logger="agent.link")
    url = control_plane(tls=False).replace("ws://", "wss://")
    _, token = enrol_node("gpu-a")
    with pytest.raises(AgentTLSError, match="it does not speak TLS \\(is it a ws:// address\\?\\)"):
        run(agent_for(url, "gpu-a", token).run())
    assert f"TLS with control plane {url} failed: it does not speak TLS" in caplog.text


def test_mutual_tls_accepts_the_certificate_named_after_the_node(control_plane, pki):
    url = control_plane(mutual=True)
    _, token = enrol_node("gpu-a")
    cert = pki["gpu-a"]
    tls = {"ca_file": str(pki["ca"].bundle), "cert_file": str(cert.cert), "key_file": str(cert.key)}
    run(says_hello(agent_for(url, "gpu-a", token, **tls), "gpu-a"))


def test_mutual_tls_refuses_another_nodes_certificate_naming_both(control_plane, pki, caplog):
    caplog.set_level(logging.WARNING, logger="agentlink.consumers")
    url = control_plane(mutual=True)
    _, token = enrol_node("gpu-a")
    other = pki["gpu-b"]
    tls = {"ca_file": str(pki["ca"].bundle), "cert_file": str(other.cert), "key_file": str(other.key)}
    with pytest.raises(AgentRejected, match="refused node “gpu-a” \\(HTTP 403\\)"):
        run(agent_for(url, "gpu-a", token, **tls).run())
    assert "certificate CN “gpu-b” does not match node “gpu-a” of the credential" in caplog.text
    assert Node.objects.get(name="gpu-a").state == NodeState.NEW


def test_mutual_tls_refuses_an_agent_without_a_certificate(control_plane, pki, caplog):
    caplog.set_level(logging.WARNING, logger="agentlink.consumers")
    url = control_plane(mutual=True)
    _, token = enrol_node("gpu-a")
    with pytest.raises(AgentRejected, match="HTTP 403"):
        run(agent_for(url, "gpu-a", token, ca_file=str(pki["ca"].bundle)).run())
    assert "node “gpu-a” presented no client certificate" in caplog.text


def test_mutual_tls_refuses_a_certificate_from_another_ca_in_the_handshake(control_plane, pki, caplog):
    caplog.set_level(logging.WARNING, logger="agent.link")
    url = control_plane(mutual=True)
    _, token = enrol_node("gpu-a")
    stranger = pki["other_ca"].issue("gpu-a")
    tls = {"ca_file": str(pki["ca"].bundle), "cert_file": str(stranger.cert), "key_file": str(stranger.key)}

    async def scenario():
        agent = agent_for(url, "gpu-a", token, **tls)
        task = asyncio.create_task(agent.run())
        for _ in range(100):
            if "was this node's certificate refused?" in caplog.text:
                break
            await asyncio.sleep(0.05)
        await agent.shutdown()
        await task

    run(scenario())
    assert "was this node's certificate refused? check --cert-file" in caplog.text
    assert Node.objects.get(name="gpu-a").state == NodeState.NEW
