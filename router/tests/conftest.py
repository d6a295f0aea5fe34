"""Fixtures for the router tests: a stand-in engine (aiohttp) and the router under uvicorn, both on 127.0.0.1.

Each runs on an event loop in a thread of its own, so tests are plain
synchronous functions and talk to them over real HTTP. Where a test kills an
engine, the engine is the bundled mock engine in a process of its own.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import uvicorn
from aiohttp import web

from conftest import free_port, wait_until
from hub import InProcessHub
from hub.contracts import EndpointRow, EndpointTable, ModelEntry
from keys.models import ApiKey
from router.accounting.ledger import Ledger
from router.app import create_app
from router.config import RouterConfig
from router.endpoints.routes import RouteTable
from router.picking.picker import Picker

PROJECT = Path(__file__).resolve().parents[2]
MODEL = "llama-3-8b"
ALIAS = "llama"


def table_rows(endpoints=(), models=None) -> dict:
    """An endpoint table as the JSON object the control plane publishes: rows given as URLs or partial dicts."""
    if models is None:
        models = {MODEL: {"aliases": [ALIAS]}}
    rows = []
    for i, ep in enumerate(endpoints):
        row = {"replica_id": str(i + 1), "model": MODEL, "priority": 0, "weight": 1, "pool": "default"}
        row.update(ep if isinstance(ep, dict) else {"url": ep})
        rows.append(row)
    return {"models": models, "endpoints": rows}


def make_table(endpoints=(), models=None, fingerprint="") -> EndpointTable:
    """An endpoint table as the control plane builds it (see table_rows)."""
    table = table_rows(endpoints, models)
    # Built as the control plane builds it: not validated, so a test can also publish a malformed one.
    return EndpointTable(
        models={name: ModelEntry(**entry) for name, entry in table["models"].items()},
        endpoints=[EndpointRow(**row) for row in table["endpoints"]],
        fingerprint=fingerprint,
    )


def table_of(rows: dict) -> EndpointTable:
    """The EndpointTable of a JSON object of the published shape (see table_rows), validated."""
    return msgspec.convert(rows, EndpointTable)


class Clock:
    """A monotonic clock that moves only when a test sets `now`."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self):
        return self.now


def new_picker(clock=None, **options) -> Picker:
    """A picker over an empty route table and a ledger, wired as RouterState wires them; `clock` stamps last use."""
    routes = RouteTable()
    return Picker(routes, Ledger(routes, clock or time.time), **options)


def pending_stamps(picker: Picker) -> dict[str, float]:
    """The last-use stamps the ledger's next take would hand over, left in place."""
    return picker.ledger.waiting_stamps()


def in_flight_by_model(picker: Picker) -> dict[str, int]:
    """Public model name -> requests in flight through the picker now (models with none left out)."""
    return {model: count for model, count in picker.ledger._in_flight.items() if count}


def chat_with_key(router, key):
    """A chat completion through `router` with bearer `key`."""
    return httpx.post(
        f"{router.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )


class ThreadedEngine:
    """A small aiohttp server on an event loop of its own thread, for tests; subclasses add their routes."""

    # Seconds aiohttp waits for handlers still running when the engine stops (aiohttp's default).
    shutdown_timeout = 60.0

    def __init__(self, name: str = "engine"):
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name=f"engine-{name}")
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def routes(self, app: web.Application) -> None:
        """Add this engine's routes to `app`."""

    def start(self):
        app = web.Application()
        self.routes(app)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(app), self._loop).result(5)
        return self

    async def _serve(self, app) -> None:
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=self.shutdown_timeout)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class FakeEngine(ThreadedEngine):
    """An engine stand-in speaking enough of the OpenAI API; its failures and delays are set by the test."""

    def __init__(self, name: str = "engine", *, status: int = 200, delay: float = 0.0):
        super().__init__(name)
        self.name = name
        self.status = status
        self.delay = delay
        self.requests: list[dict] = []
        self.active = 0
        self.max_active = 0
        # Streaming controls: hold after the first chunk until `release` is set, or stream without end;
        # with `steps`, each chunk after the first waits for one release of it.
        self.hold_first_chunk = False
        self.steps: threading.Semaphore | None = None
        self.release = threading.Event()
        self.released_in_time: bool | None = None
        self.endless = False
        self.stream_cut = threading.Event()

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/embeddings", self._embedding)

    async def _begin(self, request) -> dict:
        body = await request.json()
        self.requests.append(body)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        if self.delay:
            await asyncio.sleep(self.delay)
        return body

    async def _chat(self, request):
        body = await self._begin(request)
        try:
            if self.status != 200:
                return web.json_response({"error": {"message": f"{self.name} is overloaded"}}, status=self.status)
            if body.get("stream"):
                return await self._stream(request, body)
            return web.json_response(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 1,
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": f"hello from {self.name}"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
                }
            )
        finally:
            self.active -= 1

    async def _stream(self, request, body):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        def chunk(text):
            data = {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": body["model"],
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
            }
            return f"data: {json.dumps(data)}\n\n".encode()

        await response.write(chunk("Hello"))
        if self.hold_first_chunk:
            loop = asyncio.get_running_loop()
            self.released_in_time = await loop.run_in_executor(None, self.release.wait, 5)
        if self.endless:
            try:
                while True:
                    await asyncio.sleep(0.02)
                    await response.write(chunk("."))
            except (ConnectionError, RuntimeError):
                self.stream_cut.set()
                raise
        for data in (chunk(" from"), chunk(f" {self.name}"), b"data: [DONE]\n\n"):
            if self.steps is not None:
                await asyncio.get_running_loop().run_in_executor(None, self.steps.acquire, True, 5)
            await response.write(data)
        await response.write_eof()
        return response

    async def _completion(self, request):
        body = await self._begin(request)
        self.active -= 1
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": body["model"],
                "choices": [{"index": 0, "text": f"hi from {self.name}", "finish_reason": "stop"}],
            }
        )

    async def _embedding(self, request):
        body = await self._begin(request)
        self.active -= 1
        return web.json_response(
            {
                "object": "list",
                "model": body["model"],
                "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
            }
        )


class RouterServer:
    """A router app served by uvicorn (uvloop + httptools, as in production) in a background thread."""

    def __init__(self, app):
        self.app = app
        self.state = app.state
        self.port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, loop="uvloop", http="httptools", lifespan="on", log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True, name="router")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RouterServer:
        self._thread.start()
        deadline = time.monotonic() + 5
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("router did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(5)
        if self._thread.is_alive():
            # Graceful shutdown waits on open connections; a router left running keeps flushing
            # into the shared test Redis and would mislead later tests.
            self.server.force_exit = True
            self._thread.join(5)
        assert not self._thread.is_alive(), "router thread did not stop"


@pytest.fixture
def start_engine():
    started: list[FakeEngine] = []

    def start(name: str = "engine", **kwargs) -> FakeEngine:
        engine = FakeEngine(name, **kwargs).start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


class EngineProcess:
    """The bundled mock engine (`python -m mockengine`) as a real process, to be killed by signal."""

    def __init__(
        self,
        port: int | None = None,
        token_delay_ms: float = 0.0,
        api_key: str | None = None,
        args: tuple = (),
        env: dict[str, str] | None = None,
    ):
        self._chosen_port = port is None
        self.port = port or free_port()
        self.token_delay_ms = token_delay_ms
        self.args = args  # more of its flags (python -m mockengine --help)
        self.env = env or {}  # more of its environment (VLLM_SERVER_DEV_MODE for the sleep routes, say)
        self.api_key = api_key  # as vLLM's --api-key, given in its environment (VLLM_API_KEY) to stay out of ps
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, attempts: int = 3) -> EngineProcess:
        """Start it and wait until it answers. A port another process took between `free_port` and the engine's
        bind (other workers' servers bind port 0 in the same range) is given up for another, when it was chosen
        here."""
        chosen_here = self._chosen_port
        for attempt in range(attempts):
            argv = [sys.executable, "-m", "mockengine", "--port", str(self.port), "--model", MODEL]
            argv += ["--token-delay-ms", str(self.token_delay_ms), *self.args]
            env = {**os.environ, "VLLM_API_KEY": self.api_key or "", **self.env}
            self.process = subprocess.Popen(
                argv, cwd=PROJECT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
            try:
                wait_until(self._answers, timeout=10, interval=0.05, describe=self._describe)
                return self
            except AssertionError:
                stderr = self.process.stderr.read().decode(errors="replace") if self.process.poll() is not None else ""
                if not chosen_here or "address already in use" not in stderr or attempt == attempts - 1:
                    raise
                self.port = free_port()
        return self

    def _answers(self) -> bool:
        assert self.process is not None and self.process.poll() is None, "mock engine exited"
        try:
            return httpx.get(f"{self.url}/health", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False

    def _describe(self) -> str:
        return f"mock engine on port {self.port} exited with {self.process.poll() if self.process else None}"

    def kill(self) -> None:
        """SIGKILL, as when the node's agent dies with its engines: no goodbye, the port just refuses."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(5)


@pytest.fixture
def engine_process():
    started: list[EngineProcess] = []

    def start(
        port: int | None = None,
        token_delay_ms: float = 0.0,
        api_key: str | None = None,
        args: tuple = (),
        env: dict[str, str] | None = None,
    ) -> EngineProcess:
        engine = EngineProcess(port, token_delay_ms, api_key, args, env).start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.kill()
        if engine.process is not None and engine.process.stderr is not None:
            engine.process.stderr.close()


class PrivatePostgres:
    """A PostgreSQL cluster of the test's own (initdb under a temp dir, a free port), stopped and started at will.

    Never the shared server: the tests that take a database down take this one.
    As root, the server runs as the `postgres` user, since PostgreSQL refuses root.
    """

    def __init__(self, bin_dir: str):
        self.bin_dir = bin_dir
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="llmgw-router-pg-")
        self.data = os.path.join(self.dir, "data")
        self.log = os.path.join(self.dir, "server.log")
        self._as_owner: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
            self._as_owner = ["runuser", "-u", "postgres", "--"]

    def _run(self, tool: str, *args: str) -> None:
        argv = [*self._as_owner, os.path.join(self.bin_dir, tool), *args]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"{tool} failed: {result.stdout}{result.stderr}")

    def init(self) -> PrivatePostgres:
        self._run("initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "--no-sync", "--no-instructions")
        return self.start()

    def start(self) -> PrivatePostgres:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", self.data, "-l", self.log, "-o", options, "-w", "-t", "30", "start")
        return self

    def stop(self) -> None:
        """Fast shutdown: the server ends every session, as a restart does to the router's kept connection."""
        self._run("pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        if os.path.exists(os.path.join(self.data, "postmaster.pid")):
            self._run("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)

    def database(self) -> dict:
        """Django DATABASES settings for this cluster; connections are kept, as the router keeps them."""
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "postgres",
            "USER": "postgres",
            "HOST": "127.0.0.1",
            "PORT": str(self.port),
            "CONN_MAX_AGE": 600,
        }


def postgres_bin_dir() -> str | None:
    initdbs = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    found = initdbs[-1] if initdbs else shutil.which("initdb")
    return os.path.dirname(found) if found else None


@pytest.fixture
def private_postgres():
    bin_dir = postgres_bin_dir()
    assert bin_dir is not None, "PostgreSQL server binaries (initdb, pg_ctl) are needed: apt-get install postgresql"
    cluster = PrivatePostgres(bin_dir)
    try:
        yield cluster.init()
    finally:
        cluster.remove()


_FIXTURE_HUB = object()


@pytest.fixture
def hub():
    return InProcessHub()


@pytest.fixture
def start_router(hub):
    """Start a router on the `hub` fixture, on the hub given, or with None on the settings' hub.

    Intervals are short so tests stay fast.
    """
    started: list[RouterServer] = []

    def start(router_hub=_FIXTURE_HUB, **kwargs) -> RouterServer:
        kwargs.setdefault("activation_timeout", 3.0)
        kwargs.setdefault("poll_seconds", 0.5)
        kwargs.setdefault("flush_seconds", 0.1)
        # Connecting to a live engine on 127.0.0.1 is immediate, and to a dead one refused at once: a test of the
        # connect deadline sets its own. This one only has to outlast a busy machine (the suite runs side by side).
        kwargs.setdefault("connect_timeout", 5.0)
        kwargs.setdefault("first_byte_timeout", 5.0)
        kwargs.setdefault("idle_timeout", 5.0)
        key_cache, clock = kwargs.pop("key_cache", None), kwargs.pop("clock", time.time)
        config = RouterConfig.from_settings(**kwargs)
        app = create_app(hub if router_hub is _FIXTURE_HUB else router_hub, config, key_cache=key_cache, clock=clock)
        server = RouterServer(app).start()
        started.append(server)
        return server

    yield start
    # Every router is stopped even if one fails to: one left running flushes into the shared test Redis.
    failures = []
    for server in started:
        try:
            server.stop()
        except AssertionError as exc:
            failures.append(exc)
    assert not failures, failures


@pytest.fixture
def api_key(transactional_db):
    """A valid bearer key, committed so the router's own thread can read it."""
    return ApiKey.issue("router tests")[1]


@pytest.fixture
def auth(api_key):
    return {"Authorization": f"Bearer {api_key}"}
