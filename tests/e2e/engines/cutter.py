"""Breaking streams on purpose, for the tests and the bench of continued streams: a TCP relay that cuts an
engine's answers after a given number of SSE events (as a dying engine's connection would end), and router-only
mode started as a process on endpoints of one's choosing."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Cutter:
    """A TCP relay to `upstream` that closes a connection once the engine sent it the next cut's number of SSE
    events (`cuts`, taken in turn): the router then sees the engine break off, as when it dies."""

    def __init__(self, upstream: int, cuts: list[int]) -> None:
        self.upstream, self.cuts, self.port = upstream, cuts, free_port()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", self.port))
        self.loop.run_forever()

    async def _relay(self, client_reader, client_writer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        to_engine = asyncio.ensure_future(self._pump(client_reader, writer))
        cut, seen = None, 0
        try:
            while chunk := await reader.read(65536):
                seen += chunk.count(b"data: ")
                if cut is None and seen:
                    cut = self.cuts.pop(0) if self.cuts else 1 << 30  # a stream's answer began: its cut is set
                if cut is not None and seen >= cut:
                    # Up to the cut's event, then the connection drops mid-answer.
                    client_writer.write(chunk[: _nth(chunk, b"data: ", cut - (seen - chunk.count(b"data: ")))])
                    await client_writer.drain()
                    break
                client_writer.write(chunk)
                await client_writer.drain()
        finally:
            to_engine.cancel()
            for each in (writer, client_writer):
                each.transport.abort()

    @staticmethod
    async def _pump(reader, writer) -> None:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()


def _nth(data: bytes, needle: bytes, n: int) -> int:
    """Where the `n`-th occurrence of `needle` in `data` ends its event (the blank line after it), or the end."""
    at = -1
    for _ in range(n):
        at = data.find(needle, at + 1)
    end = data.find(b"\n\n", at)
    return len(data) if end < 0 else end + 2


def start_router(workdir: Path, model: str, way: str, cutter: int, engine: int) -> tuple[subprocess.Popen, str, str]:
    """Router-only mode serving `model` from the engine behind the cutter (first: the higher priority) and the
    engine itself, continuing broken streams `way`; (process, URL, a client key)."""
    rows = [{"url": f"http://127.0.0.1:{cutter}", "priority": 1}, f"http://127.0.0.1:{engine}"]
    return router_only(workdir, model, way, rows)


def router_only(workdir: Path, model: str, way: str, endpoints: list) -> tuple[subprocess.Popen, str, str]:
    """Router-only mode (`manage.py router --endpoints`, a database of its own in `workdir`) serving `model` from
    `endpoints` (rows of the endpoints file), continuing broken streams `way`; (process, URL, a client key)."""
    workdir.mkdir(parents=True, exist_ok=True)
    table = workdir / "endpoints.yaml"
    table.write_text(json.dumps({"models": {model: {"endpoints": endpoints, "streams": way}}}))
    return router_process(workdir, f"streams-{way}", ["--endpoints", str(table)])


def router_process(
    workdir: Path, key_name: str, router_args: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str, str]:
    """`manage.py router ROUTER_ARGS` on a SQLite database of its own in `workdir`, with a client key named
    `key_name`, once it is ready; no Redis unless `env` (added to its environment) names one. (process, URL, key)."""
    base = {**os.environ, "LLMGW_HOME": str(workdir), "SECRET_KEY": "test-only", "LOG_LEVEL": "WARNING"}
    base.pop("DATABASE_URL", None)
    base.pop("REDIS_URL", None)
    env = {**base, **(env or {})}
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    key = subprocess.run(
        [*manage, "keys", "create", key_name], cwd=ROOT, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()
    port = free_port()
    argv = [*manage, "router", "--port", str(port), *router_args]
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return process, url, key
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the router did not get ready")


def streamed_text(url: str, body: dict, key: str | None = None) -> tuple[str, list[int], list]:
    """(the answer's text, its token ids, the error events) of a chat stream."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text, ids, errors = [], [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"])
                for choice in event.get("choices", ()):
                    text.append(choice["delta"].get("content") or "")
                    ids += choice.get("token_ids") or ()
    return "".join(text), ids, errors
