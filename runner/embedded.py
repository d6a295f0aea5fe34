"""Embedded mode: control plane, router, reconcile ticker (and demo agents) in one process.

All of them share one event loop. Django's synchronous work (views, the agent
consumer's writes, the tick) runs on asgiref's single sync thread, so SQLite
sees one writer at a time, and the tick's channel-layer sends run on this loop,
where the in-memory channel layer lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import ssl
import sys

import uvicorn
from django.conf import settings

from agent.engines.vllm_command import vllm_command_from
from agent.gpus.discovery import parse_fake_gpus
from agent.options import AgentOptions
from agent.runtime import Agent
from agentlink.tls import TLSWebSocketProtocol
from hub import get_hub
from router.app import create_app
from router.serving import server_options
from runner.demo import DemoFleet
from runner.ticker import Ticker

log = logging.getLogger("llmgw.up")


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the embedding process."""

    def capture_signals(self):
        return contextlib.nullcontext()


def bind(host: str, port: int) -> socket.socket:
    """Bind a listening socket, or raise OSError naming the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # Named TCP, not protocol 0: asyncio sets TCP_NODELAY only on connections whose socket says IPPROTO_TCP, and
    # without it a keep-alive client's every request after the first waited ~40 ms (Nagle and delayed ACKs).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def control_plane_options() -> dict:
    """uvicorn options of the control plane: TLS from the LLMGW_TLS_* settings, and the TLS-aware WebSocket.

    A client CA makes a client certificate optional at the TLS layer (browsers on
    /admin have none) and required by the agent link, which checks its CN
    (agentlink/tls.py, agentlink/consumers.py).
    """
    options: dict = {"lifespan": "off", "log_level": "warning", "ws": TLSWebSocketProtocol}
    if settings.LLMGW_TLS_CERT_FILE:
        options |= {"ssl_certfile": settings.LLMGW_TLS_CERT_FILE, "ssl_keyfile": settings.LLMGW_TLS_KEY_FILE or None}
    if settings.LLMGW_TLS_CLIENT_CA_FILE:
        options |= {"ssl_ca_certs": settings.LLMGW_TLS_CLIENT_CA_FILE, "ssl_cert_reqs": ssl.CERT_OPTIONAL}
    return options


async def serve(host: str, port: int, router_port: int, fleet: DemoFleet | None = None, on_ready=None) -> None:
    """Run everything until SIGINT/SIGTERM; then stop engines, servers and the ticker."""
    control_sock = bind(host, port)
    try:
        router_sock = bind(host, router_port)
    except OSError:
        control_sock.close()
        raise
    control = _Server(uvicorn.Config("llmgw_site.asgi:application", **control_plane_options()))
    # Served as a router process serves it (its loop is this process's, already running).
    router = _Server(uvicorn.Config(create_app(), **server_options(settings.LLMGW_SHUTDOWN_GRACE_SECONDS)))

    stop = asyncio.Event()
    ticker = Ticker(get_hub())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    tasks = [
        asyncio.create_task(control.serve(sockets=[control_sock]), name="control-plane"),
        asyncio.create_task(router.serve(sockets=[router_sock]), name="router"),
        asyncio.create_task(ticker.run(), name="ticker"),
    ]
    while not (control.started and router.started):
        if any(t.done() for t in tasks):
            break
        await asyncio.sleep(0.05)

    agents = [] if fleet is None else start_agents(fleet, host, port, tasks)
    if on_ready is not None:
        on_ready()

    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
    failure = next((t for t in done if t is not stopper and t.exception() is not None), None)
    if failure is not None:
        log.error("%s stopped: %s", failure.get_name(), failure.exception())

    stop.set()
    await shut_down(agents, ticker, [control, router], tasks)
    if failure is not None and (exception := failure.exception()) is not None:
        raise exception


def start_agents(fleet: DemoFleet, host: str, port: int, tasks: list[asyncio.Task]) -> list[Agent]:
    """Start an agent for each node of the demo fleet, connected to the control plane at `host:port`; their
    tasks join `tasks`."""
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    scheme = "wss" if settings.LLMGW_TLS_CERT_FILE else "ws"
    url = f"{scheme}://{connect_host}:{port}/agent/ws"
    agents = []
    for node in fleet.nodes:
        agent = Agent(
            AgentOptions(
                [url],
                node.name,
                node.token,
                parse_fake_gpus(node.fake_gpus, node.name),
                address="127.0.0.1",
                fabric=node.fabric,
                heartbeat_seconds=settings.LLMGW_HEARTBEAT_SECONDS,
                engine_python=sys.executable,
                llama_server=settings.LLMGW_LLAMA_SERVER,
                vllm_command=vllm_command_from(settings.LLMGW_VLLM_COMMAND),
                ca_file=settings.LLMGW_AGENT_CA_FILE or None,
            )
        )
        agents.append(agent)
        tasks.append(asyncio.create_task(agent.run(), name=f"agent-{node.name}"))
    return agents


async def shut_down(
    agents: list[Agent], ticker: Ticker, servers: list[uvicorn.Server], tasks: list[asyncio.Task]
) -> None:
    """Engines first (while the control plane can still hear their last status), then the ticker, then the
    servers; whatever is still running after that is cancelled."""
    ticker.stop()
    await asyncio.gather(*(a.shutdown() for a in agents), return_exceptions=True)
    for server in servers:
        server.should_exit = True
    await asyncio.wait(tasks, timeout=15)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
