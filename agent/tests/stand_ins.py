"""Stand-ins shared by the agent's tests: control planes on 127.0.0.1 (real websockets servers), and bad command lines.

Engines are the bundled mock engine, started by the agent as real subprocesses.
"""

import asyncio
import contextlib
import json
import os
import queue
import threading

import httpx
from websockets.asyncio.server import serve as serve_async
from websockets.sync.server import serve

from agent.gpus.discovery import parse_fake_gpus
from agent.options import AgentOptions
from agent.runtime import Agent
from conftest import free_port
from nodewire import adapter_messages, protocol


class ThreadedControlPlane:
    """A stand-in /agent/ws served from a thread, for commands that run their own event loop."""

    def __init__(self, reject_status: int | None = None):
        self.reject_status = reject_status
        self.messages: queue.Queue = queue.Queue()

    def __enter__(self):
        self.server = serve(self._handler, "127.0.0.1", 0, process_request=self._process_request)
        self.url = f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}/agent/ws"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.thread.join(5)

    def _process_request(self, connection, request):
        if self.reject_status is not None:
            return connection.respond(self.reject_status, "refused\n")
        return None

    def _handler(self, ws):
        try:
            for raw in ws:
                self.messages.put(json.loads(raw))
        except Exception:
            pass


CP = "ws://127.0.0.1:9/agent/ws"


# Bad command lines and what the refusal must name; `manage.py agent` and `python -m agent` say the same.
BAD_ARGUMENTS = [
    (["--node", "n1", "--token", "t"], "at least one --control-plane"),
    (["--control-plane", "http://cp/agent/ws", "--node", "n1", "--token", "t"], "must be a ws:// or wss:// URL"),
    (["--control-plane", CP, "--node", "bad name!", "--token", "t"], "Node name 'bad name!'"),
    (["--control-plane", CP, "--node", "n1"], "--token or the LLMGW_NODE_TOKEN"),
    (["--control-plane", CP, "--node", "n1", "--token", "t", "--label", "rack"], "Label 'rack' is not key=value"),
    (["--control-plane", CP, "--node", "n1", "--token", "t", "--fake-gpus", "8xH100"], "Cannot discover GPUs"),
    (["--control-plane", CP, "--node", "n1", "--token", "t", "--heartbeat-seconds", "0"], "must be positive"),
]


NODE = "gpu-test-01"
TOKEN = "llmgw-node-secret"


class ControlPlane:
    """A stand-in for /agent/ws that records what the agent says and sends it commands."""

    def __init__(self, reject_status: int | None = None, close_code: int | None = None):
        self.reject_status = reject_status
        self.close_code = close_code
        self.messages: asyncio.Queue = asyncio.Queue()
        self.headers: list[dict] = []
        self.connections = 0
        self.frame_types: set[type] = set()
        self.ws = None

    async def __aenter__(self):
        self.server = await serve_async(self._handler, "127.0.0.1", 0, process_request=self._process_request)
        self.url = f"ws://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/agent/ws"
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()

    def _process_request(self, connection, request):
        self.headers.append({k.lower(): v for k, v in request.headers.raw_items()})
        if self.reject_status is not None:
            return connection.respond(self.reject_status, "refused\n")
        return None

    async def _handler(self, ws):
        self.ws = ws
        self.connections += 1
        if self.close_code is not None:
            await ws.close(self.close_code, "go away")
            return
        with contextlib.suppress(Exception):
            async for raw in ws:
                self.frame_types.add(type(raw))
                await self.messages.put(json.loads(raw))

    async def next(self, kind: str, timeout: float = 5.0) -> dict:
        """The next message of `kind`, skipping others (heartbeats arrive all the time)."""
        async with asyncio.timeout(timeout):
            while True:
                message = await self.messages.get()
                if message["type"] == kind:
                    return message

    async def send(self, message: dict) -> None:
        await self.ws.send(json.dumps(message))


def start_command(shard_id: int, port: int, epoch: int = 1, **overrides) -> dict:
    fields = {
        "shard_id": shard_id,
        "replica_id": 70 + shard_id,
        "rank": 0,
        "node_count": 1,
        "head_address": "",
        "engine": "mock",
        "model": "mock-small",
        "source": "mock-small",
        "gpu_indices": [0, 1],
        "port": port,
        "args": [],
        "env": {},
        **overrides,
    }
    return command(protocol.START_SHARD, epoch, **fields)


def command(kind: str, epoch: int, **fields) -> dict:
    """A control-plane command as the agent receives it (plain data), built through its struct."""
    struct = {
        protocol.START_SHARD: protocol.StartShard,
        protocol.STOP_SHARD: protocol.StopShard,
        protocol.DRAIN_SHARD: protocol.DrainShard,
        protocol.SLEEP_SHARD: protocol.SleepShard,
        protocol.WAKE_SHARD: protocol.WakeShard,
        protocol.REMOVE_WEIGHTS: protocol.RemoveWeights,
        adapter_messages.LOAD_ADAPTER: adapter_messages.LoadAdapter,
        adapter_messages.UNLOAD_ADAPTER: adapter_messages.UnloadAdapter,
    }[kind]
    return protocol.to_builtins(struct(epoch=epoch, **fields))


def checked(message: dict) -> dict:
    """An agent's message as the control plane's gate lets it through, as plain data (defaults filled in)."""
    return protocol.to_builtins(protocol.decode_agent_message(json.dumps(message)))


def make_agent(control_planes: list[str], **overrides) -> Agent:
    options = {"heartbeat_seconds": 0.1, "health_timeout": 10.0, "stop_grace_seconds": 3.0, **overrides}
    return Agent(
        AgentOptions(control_planes, NODE, TOKEN, parse_fake_gpus("2xH100-80GB", NODE), "127.0.0.1", **options)
    )


def run(coro, timeout: float = 20.0):
    async def bounded():
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def health(port: int) -> int:
    async with httpx.AsyncClient(trust_env=False, timeout=2) as client:
        return (await client.get(f"http://127.0.0.1:{port}/health")).status_code


PROMPT = "one two three four five six seven eight nine ten eleven twelve"  # 16 tokens in the reply


async def start_ready(cp: ControlPlane, shard_id: int, *args: str, epoch: int = 1, **fields) -> int:
    """Start a mock engine with `args` (and start_command's other `fields`); return its port once it is ready."""
    port = free_port()
    await cp.send(start_command(shard_id, port, epoch, args=list(args), **fields))
    starting = await cp.next(protocol.SHARD_STATUS)
    assert (starting["shard_id"], starting["state"]) == (shard_id, "starting"), starting
    ready = await cp.next(protocol.SHARD_STATUS)
    assert (ready["shard_id"], ready["state"], ready["port"]) == (shard_id, "ready", port), ready
    return port


async def open_stream(port: int, first_chunk: asyncio.Event) -> list[str]:
    """A streaming chat request; sets `first_chunk` once the engine is answering; returns the data lines."""
    body = {"model": "mock-small", "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
    lines = []
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    async with (
        httpx.AsyncClient(trust_env=False, timeout=30) as client,
        client.stream("POST", url, json=body) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                lines.append(line)
                first_chunk.set()
    return lines


async def fresh_heartbeat(cp: ControlPlane) -> dict:
    """A heartbeat built from now on: the queued ones are older, and the one being built may be too."""
    queued = [cp.messages.get_nowait() for _ in range(cp.messages.qsize())]
    for message in queued:
        if message["type"] != protocol.HEARTBEAT:
            cp.messages.put_nowait(message)
    await cp.next(protocol.HEARTBEAT)
    return checked(await cp.next(protocol.HEARTBEAT))
