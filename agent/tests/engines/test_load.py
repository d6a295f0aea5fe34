"""Reading an engine's requests in flight from its /metrics: each engine's names, garbage, slow engines."""

import asyncio
import time
from pathlib import Path

import pytest
from aiohttp import web

from agent.engines.load import EngineLoad, requests_in_flight
from agent.tests.stand_ins import run
from mockengine.batch import MockBatch
from mockengine.generation import MockEngine

DATA = Path(__file__).parents[1] / "data"


@pytest.mark.parametrize(
    ("sample", "expected"),
    [
        # 3 running + 1 waiting.
        ("metrics_vllm.txt", 4),
        # Two data-parallel engine cores, both idle.
        ("metrics_vllm_two_engines_idle.txt", 0),
        # 2 running + 1 queued, reported identically by both tensor-parallel ranks: counted once.
        ("metrics_sglang_tp2.txt", 3),
        # 1 slot processing + 2 deferred.
        ("metrics_llamacpp.txt", 3),
        # Captured from a real llama-server (make llama-server): idle, and known to be.
        ("metrics_llamacpp_idle_real.txt", 0),
    ],
)
def test_each_engines_recorded_metrics_give_its_requests_in_flight(sample, expected):
    assert requests_in_flight((DATA / sample).read_text()) == expected


def test_data_parallel_label_sets_add_up():
    text = (DATA / "metrics_vllm_two_engines_idle.txt").read_text()
    busy = text.replace(
        'vllm:num_requests_running{engine="1",model_name="llama-70b"} 0.0',
        'vllm:num_requests_running{engine="1",model_name="llama-70b"} 5.0',
    )
    assert busy != text
    assert requests_in_flight(busy) == 5


def test_the_mock_engine_speaks_vllms_names():
    async def go():
        engine = MockEngine("mock-small", batch=MockBatch(max_num_seqs=2))
        assert requests_in_flight(engine.render_metrics()) == 0
        await engine.batch.enter()
        await engine.batch.enter()
        third = asyncio.ensure_future(engine.batch.enter())  # waits in the engine's own queue
        await asyncio.sleep(0)
        in_flight = requests_in_flight(engine.render_metrics())
        third.cancel()
        return in_flight

    assert asyncio.run(go()) == 3


@pytest.mark.parametrize(
    "body",
    [
        "",
        "<html><body>502 Bad Gateway</body></html>",
        '{"detail": "Not Found"}',
        # Prometheus text, but without any engine's running gauge.
        "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\n",
        # Only the queue gauge: the running one is what says the engine reports its load.
        "vllm:num_requests_waiting 0\n",
        # The family is declared but no label set has a value yet.
        "# HELP sglang:num_running_reqs The number of running requests.\n# TYPE sglang:num_running_reqs gauge\n",
        "vllm:num_requests_running NaN\n",
        "vllm:num_requests_running -1\n",
        'vllm:num_requests_running{model_name="m 3\n',
    ],
)
def test_a_body_that_does_not_say_reads_as_unknown_not_idle(body):
    assert requests_in_flight(body) is None


async def serve(handler) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def test_reading_a_slow_engine_gives_up_after_the_timeout_and_others_are_read_meanwhile():
    async def slow(request):
        await asyncio.sleep(10)
        return web.Response(text="vllm:num_requests_running 1\n")

    async def busy(request):
        return web.Response(text=MockEngine("m").render_metrics().replace("} 0.0", "} 2.0", 1))

    async def scenario():
        slow_runner, slow_port = await serve(slow)
        busy_runner, busy_port = await serve(busy)
        load = EngineLoad(timeout=0.3)
        try:
            started = time.monotonic()
            counts = await load.read_many(
                {1: (slow_port, "/metrics"), 2: (busy_port, "/metrics"), 3: (busy_port, None)}
            )
            elapsed = time.monotonic() - started
        finally:
            await load.aclose()
            await slow_runner.cleanup()
            await busy_runner.cleanup()
        assert counts == {1: None, 2: 2, 3: None}
        # Concurrent and bounded: the slow engine costs the timeout once, not on top of the others.
        assert elapsed < 1.0

    run(scenario())


def test_an_engine_that_is_not_listening_or_answers_an_error_reads_as_unknown():
    async def failing(request):
        return web.Response(status=500, text="vllm:num_requests_running 0\n")

    async def scenario():
        runner, port = await serve(failing)
        load = EngineLoad(timeout=0.5)
        try:
            closed_port = port + 1 if port < 65535 else port - 1
            assert await load.read(port, "/metrics") is None
            assert await load.read(closed_port, "/metrics") is None
        finally:
            await load.aclose()
            await runner.cleanup()

    run(scenario())


SGLANG_DECLARED = (
    "# HELP sglang:num_running_reqs The number of running requests.\n# TYPE sglang:num_running_reqs gauge\n"
    "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n# TYPE sglang:num_queue_reqs gauge\n"
)
SGLANG_COUNTERS = (
    "# HELP sglang:num_requests_total The number of requests finished.\n# TYPE sglang:num_requests_total counter\n"
    "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.\n"
    "# TYPE sglang:prompt_tokens_total counter\n"
)


@pytest.mark.parametrize(
    ("counters", "expected"),
    [
        # Started and never asked anything: its gauges and counters are declared, none has a value yet.
        (SGLANG_COUNTERS, 0),
        # Counters with a label set at 0 (and the time it was made) say the same.
        (SGLANG_COUNTERS + 'sglang:num_requests_total{model_name="m"} 0.0\n'
         'sglang:num_requests_created{model_name="m"} 1.7e9\n', 0),
        # It has served requests, yet its gauges have no value: that is not a reading.
        (SGLANG_COUNTERS + 'sglang:prompt_tokens_total{model_name="m"} 12.0\n', None),
        # Without the counters nothing says it served nothing.
        ("", None),
    ],
)  # fmt: skip
def test_an_sglang_that_has_served_nothing_reads_as_idle_before_its_first_batch(counters, expected):
    assert requests_in_flight(SGLANG_DECLARED + counters) == expected


def test_an_sglang_with_a_queued_request_before_its_first_batch_counts_it():
    queued = 'sglang:num_queue_reqs{model_name="m",tp_rank="0"} 1.0\n'
    assert requests_in_flight(SGLANG_DECLARED + SGLANG_COUNTERS + queued) == 1
