"""The engines' own load as the router polls it: parsing each engine's names, the poller, and picks end to end.

End to end runs real engines on 127.0.0.1: the bundled mock engine in its own
process (its KV cache usage follows its running requests, `CACHE_SLOTS`), and a
small aiohttp engine whose /metrics the test sets (the mock engine never
reports a queue).
"""

import asyncio
import subprocess
import sys
import threading

import aiohttp
import httpx
import pytest
from aiohttp import web

from conftest import free_port, wait_until
from mockengine.generation import CACHE_SLOTS
from router.picking.engine_load import UNKNOWN, EngineLoadPoller, EngineReading, parse_engine_load
from router.picking.picker import Picker
from router.tests.conftest import MODEL, PROJECT, ThreadedEngine, make_table, new_picker

# -- parsing -----------------------------------------------------------------------------------


def gauge(name: str, *samples: str) -> str:
    return f"# HELP {name} x\n# TYPE {name} gauge\n" + "".join(f"{name}{s}\n" for s in samples)


def test_vllm_waiting_and_kv_cache_usage_are_read():
    text = gauge("vllm:num_requests_waiting", '{model_name="m"} 3.0') + gauge(
        "vllm:gpu_cache_usage_perc", '{model_name="m"} 0.25'
    )
    assert parse_engine_load(text) == EngineReading(3.0, 0.25)


def test_newer_vllm_kv_cache_name_is_preferred_and_data_parallel_engines_add_up():
    text = (
        gauge("vllm:num_requests_waiting", '{engine="0",model_name="m"} 2.0', '{engine="1",model_name="m"} 5.0')
        + gauge("vllm:kv_cache_usage_perc", '{engine="0",model_name="m"} 0.5', '{engine="1",model_name="m"} 0.7')
        + gauge("vllm:gpu_cache_usage_perc", '{engine="0",model_name="m"} 0.0')
        + gauge("vllm:num_requests_waiting_by_reason", '{reason="x"} 100.0')
    )
    # Waiting requests add up; KV usage averages over the engine cores (one full core is not a full replica).
    assert parse_engine_load(text) == EngineReading(7.0, pytest.approx(0.6))


def test_sglang_names_count_a_tensor_parallel_group_once():
    text = gauge("sglang:num_queue_reqs", '{tp_rank="0"} 4', '{tp_rank="1"} 4') + gauge(
        "sglang:token_usage", '{tp_rank="0"} 0.96', '{tp_rank="1"} 0.96'
    )
    assert parse_engine_load(text) == EngineReading(4.0, 0.96)


def test_llama_cpp_names_are_read():
    text = gauge("llamacpp:requests_deferred", " 2") + gauge("llamacpp:kv_cache_usage_ratio", " 0.5")
    assert parse_engine_load(text) == EngineReading(2.0, 0.5)


def test_a_real_llama_server_page_gives_its_queue_and_no_kv_usage():
    # Captured from the llama-server `make llama-server` builds: it publishes no KV cache gauge any more.
    text = (PROJECT / "agent" / "tests" / "data" / "metrics_llamacpp_idle_real.txt").read_text()
    assert parse_engine_load(text) == EngineReading(0.0, None)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", UNKNOWN),
        ("<html>not metrics</html>", UNKNOWN),
        ("vllm:num_requests_waiting{model_name= 3\n", UNKNOWN),  # does not parse
        (gauge("vllm:num_requests_running", " 3"), UNKNOWN),  # neither figure exposed
        (gauge("vllm:num_requests_waiting", " NaN") + gauge("vllm:gpu_cache_usage_perc", " 0.5"), (None, 0.5)),
        (gauge("vllm:num_requests_waiting", " 1") + gauge("vllm:gpu_cache_usage_perc", " -1"), (1.0, None)),
        (gauge("vllm:gpu_cache_usage_perc", " 1.7"), (None, 1.0)),  # above full reads as full
    ],
)
def test_missing_or_senseless_figures_are_unknown(text, expected):
    reading = parse_engine_load(text)
    assert (reading.waiting, reading.kv_usage) == tuple(expected if isinstance(expected, tuple) else (None, None))


def test_the_mock_engines_metrics_are_read():
    from mockengine.generation import MockEngine

    engine = MockEngine(MODEL)
    engine.batch.running = CACHE_SLOTS // 2
    assert parse_engine_load(engine.render_metrics()) == EngineReading(0.0, 0.5)


# -- a small engine whose /metrics the test sets -----------------------------------------------


class MetricsEngine(ThreadedEngine):
    """An aiohttp engine answering chat completions with its name, and /metrics with what the test sets."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name
        self.metrics = ""
        self.status = 200
        self.delay = 0.0
        self.served = 0

    def report(self, waiting: float, kv_usage: float) -> None:
        self.metrics = gauge("vllm:num_requests_waiting", f" {waiting}") + gauge(
            "vllm:kv_cache_usage_perc", f" {kv_usage}"
        )

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._chat)

    async def _metrics(self, request):
        if self.delay:
            await asyncio.sleep(self.delay)
        return web.Response(text=self.metrics, status=self.status)

    async def _chat(self, request):
        body = await request.json()
        self.served += 1
        message = {"role": "assistant", "content": f"hello from {self.name}"}
        return web.json_response(
            {"object": "chat.completion", "model": body["model"], "choices": [{"index": 0, "message": message}]}
        )


@pytest.fixture
def metrics_engine():
    started: list[MetricsEngine] = []

    def start(name: str) -> MetricsEngine:
        engine = MetricsEngine(name).start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


def poll(picker: Picker, timeout: float = 0.5) -> None:
    """One round of the poller over every endpoint of `picker`."""

    async def once():
        poller = EngineLoadPoller(picker.routes, picker, poll_seconds=1.0, timeout=timeout)
        poller.open()
        try:
            await poller.poll_once()
        finally:
            await poller.close()

    asyncio.run(once())


def test_poller_records_each_engines_load_and_unknown_for_those_that_fail(metrics_engine):
    good, broken, slow, garbage = (metrics_engine(n) for n in ("good", "broken", "slow", "garbage"))
    good.report(2, 0.5)
    broken.report(9, 0.99)
    broken.status = 500
    slow.report(9, 0.99)
    slow.delay = 2.0
    garbage.metrics = "<html>teapot</html>"
    refused = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    picker = new_picker()
    picker.routes.apply_table(make_table([e.url for e in (good, broken, slow, garbage)] + [refused]))
    endpoints = picker.routes.endpoints(MODEL)
    for endpoint in endpoints:
        picker.record_engine_load(endpoint, 1, 0.1)  # a previous reading, to be replaced
    poll(picker, timeout=0.3)
    figures = [(e.engine_waiting, e.kv_usage, e.queued, e.kv_full) for e in endpoints]
    assert figures == [(2.0, 0.5, 2.0, False)] + [(None, None, 0.0, False)] * 4


def test_waiting_requests_reported_by_an_engine_steer_requests_through_the_router(
    settings, start_router, hub, auth, metrics_engine
):
    settings.LLMGW_ENGINE_POLL_SECONDS = 0.1
    a, b = metrics_engine("a"), metrics_engine("b")
    a.report(waiting=10, kv_usage=0.1)  # another router's requests queue at a
    b.report(waiting=0, kv_usage=0.1)
    hub.publish_endpoints(make_table([a.url, b.url]))
    router = start_router()
    wait_until(lambda: [e.engine_waiting for e in router.state.routes.endpoints(MODEL)] == [10, 0])
    assert {chat(router, auth, f"question {i}") for i in range(6)} == {"2"}
    a.report(waiting=0, kv_usage=0.1)
    b.report(waiting=10, kv_usage=0.1)
    wait_until(lambda: [e.engine_waiting for e in router.state.routes.endpoints(MODEL)] == [0, 10])
    assert {chat(router, auth, f"question {i}") for i in range(6)} == {"1"}
    metrics = httpx.get(f"{router.url}/metrics").text
    assert f'llmgw_router_engine_waiting_requests{{model="{MODEL}",replica="2"}} 10.0' in metrics
    assert f'llmgw_router_engine_kv_cache_usage_ratio{{model="{MODEL}",replica="1"}} 0.1' in metrics


# -- end to end with the bundled mock engine -------------------------------------------------------


def chat(router, auth, prompt: str) -> str:
    """One chat completion through the router; the replica that answered."""
    response = httpx.post(
        f"{router.url}/v1/chat/completions",
        headers=auth,
        # One token: quick even from an engine with a token delay.
        json={"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    return response.headers["x-llmgw-replica"]


class MockEngineProcess:
    """`python -m mockengine` with a token delay, so requests to it stay running for a while."""

    def __init__(self, token_delay_ms: float):
        self.port = free_port()
        argv = [sys.executable, "-m", "mockengine", "--port", str(self.port), "--model", MODEL]
        argv += ["--token-delay-ms", str(token_delay_ms)]
        self.process = subprocess.Popen(argv, cwd=PROJECT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._answers, timeout=10, interval=0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _answers(self) -> bool:
        assert self.process.poll() is None, "mock engine exited"
        try:
            return httpx.get(f"{self.url}/health", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False

    def running(self) -> int:
        text = httpx.get(f"{self.url}/metrics", timeout=2).text
        line = next(line for line in text.splitlines() if line.startswith("vllm:num_requests_running"))
        return int(float(line.rsplit(" ", 1)[1]))

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(5)


@pytest.fixture
def mock_engine():
    started: list[MockEngineProcess] = []

    def start(token_delay_ms: float = 0.0) -> MockEngineProcess:
        engine = MockEngineProcess(token_delay_ms)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


# Twelve words: the mock engine answers with 16 tokens, so a held stream lasts 16 token delays.
LONG_PROMPT = "one two three four five six seven eight nine ten eleven twelve"


class HeldStreams:
    """`count` streaming chat requests kept open against `url`, until `close()`; the engine counts them running."""

    def __init__(self, url: str, count: int, headers: dict | None = None, prompt: str = LONG_PROMPT):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="held-streams")
        self._thread.start()
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": prompt}]}
        self._task = asyncio.run_coroutine_threadsafe(self._start(url, count, body, headers or {}), self._loop).result(
            5
        )

    async def _start(self, *args) -> asyncio.Task:
        return asyncio.ensure_future(self._hold(*args))

    async def _hold(self, url, count, body, headers):
        async with aiohttp.ClientSession() as session:

            async def one():
                async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
                    assert response.status == 200
                    async for _ in response.content.iter_any():
                        pass

            await asyncio.gather(*(one() for _ in range(count)))

    def close(self) -> None:
        """Cut the streams (the engine stops generating them) and wait until they are closed."""

        async def stop():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


def test_a_replica_whose_kv_cache_is_full_is_skipped_until_it_drains(settings, start_router, hub, auth, mock_engine):
    settings.LLMGW_ENGINE_POLL_SECONDS = 0.1
    settings.LLMGW_KV_CACHE_FULL_FRACTION = 0.25
    busy, idle = mock_engine(token_delay_ms=500), mock_engine()
    hub.publish_endpoints(make_table([busy.url, idle.url]))
    router = start_router()
    picker = router.state.picker
    # Streams sent to the engine directly (another router's, say): only its /metrics tells this router.
    held = HeldStreams(busy.url, CACHE_SLOTS // 4)
    try:
        wait_until(lambda: busy.running() == CACHE_SLOTS // 4, timeout=5)
        wait_until(lambda: picker.routes.endpoints(MODEL)[0].kv_full, timeout=3)
        assert {chat(router, auth, f"question {i}") for i in range(8)} == {"2"}
        metrics = httpx.get(f"{router.url}/metrics").text
        assert f'llmgw_router_engine_kv_cache_usage_ratio{{model="{MODEL}",replica="1"}} 0.25' in metrics
    finally:
        held.close()
    wait_until(lambda: not picker.routes.endpoints(MODEL)[0].kv_full, timeout=5)
    # New conversations (the ones above stay where their cache now is): both replicas again.
    assert {chat(router, auth, f"another question {i}") for i in range(8)} == {"1", "2"}


def test_prefix_affinity_sticks_within_the_slack_and_moves_beyond_it(settings, start_router, hub, auth, mock_engine):
    settings.LLMGW_PREFIX_AFFINITY_SLACK = 2
    a, b = mock_engine(token_delay_ms=300), mock_engine(token_delay_ms=300)
    hub.publish_endpoints(make_table([a.url, b.url]))
    router = start_router()
    shared = "You are a support agent for ACME. Answer briefly: " + LONG_PROMPT
    # Idle: every request with the prefix goes to one replica, so its engine can reuse the prefix's KV cache.
    first = chat(router, auth, shared)
    assert {chat(router, auth, shared) for _ in range(4)} == {first}
    held = HeldStreams(router.url, 3, auth, prompt=shared)
    try:
        # Three in flight on the preferred replica, none on the other: beyond the slack of 2, so it moves.
        wait_until(lambda: router.state.ledger.in_flight() == 3, timeout=5)
        assert [e.outstanding for e in router.state.routes.endpoints(MODEL) if e.replica_id == first] == [3]
        moved = chat(router, auth, shared)
        assert moved != first
    finally:
        held.close()
    wait_until(lambda: router.state.ledger.in_flight() == 0, timeout=5)
    # Idle again: the prefix stays where it was last sent, whose cache holds it too.
    assert chat(router, auth, shared) == moved
