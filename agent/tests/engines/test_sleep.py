"""The sleep and wake calls of each engine dialect (agent/engines/sleep.py), against a recording HTTP server on
127.0.0.1 that answers as the engine would, and against the mock engine served in-process (it is driven as a
subprocess by the agent in test_agent_sleep.py, and the real vLLM in tests/e2e/engines/test_vllm.py)."""

import asyncio
import contextlib
import json

import httpx
import pytest
from aiohttp import web

from agent.engines.sleep import EngineSleep, EngineSleepError, level_problem
from agent.tests.stand_ins import run
from mockengine.server import create_app
from mockengine.sleep import NO_WEIGHTS

VLLM_MEMORY = {"weights", "kv_cache"}


class Recorder:
    """An engine stand-in: records each call, answers from `answers` (path with its query, or path alone ->
    (status, body)), else as vLLM 0.32: its memory (`weights`, `kv_cache`) sleeps and wakes, whole or by tag."""

    def __init__(self, answers: dict | None = None):
        self.calls: list[str] = []
        self.answers = answers or {}
        self.asleep: set[str] = set()

    async def handle(self, request: web.Request) -> web.Response:
        body = (await request.text()) or ""
        self.calls.append(f"{request.method} {request.path_qs}{' ' + body if body else ''}")
        for key in (request.path_qs, request.path):
            if key in self.answers:
                status, text = self.answers[key]
                return web.Response(status=status, text=text)
        if request.path == "/sleep":
            self.asleep = set(VLLM_MEMORY)
        elif request.path == "/wake_up":
            tags = request.query.getall("tags", [])
            self.asleep -= set(tags) if tags else VLLM_MEMORY
            return web.json_response({"status": "sleeping" if self.asleep else "awake", "tags": tags or None})
        elif request.path == "/is_sleeping":
            return web.json_response({"is_sleeping": bool(self.asleep)})
        elif request.path == "/reset_prefix_cache":
            return web.json_response({"success": True})
        return web.Response(status=200)


def engine(recorder: Recorder):
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", recorder.handle)
    return serve(app)


@contextlib.asynccontextmanager
async def serve(app: web.Application):
    """`app` served on 127.0.0.1; yields a client and its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with httpx.AsyncClient(trust_env=False) as client:
            yield client, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_vllm_level_2_reloads_the_weights_and_resets_the_prefix_cache_before_scheduling_resumes():
    # vLLM resumes scheduling once all its memory is back: a tagless wake would run what was queued during the
    # sleep before the reload. By parts, the KV cache (the last) wakes only once the weights are reloaded.
    recorder = Recorder()

    async def scenario():
        async with engine(recorder) as (client, url):
            calls = EngineSleep(client, url, "vllm")
            await calls.sleep(2)
            await calls.wake(2)

    run(scenario())
    assert recorder.calls == [
        "POST /sleep?level=2&mode=wait",
        "GET /is_sleeping",
        "POST /wake_up?tags=weights",
        'POST /collective_rpc {"method":"reload_weights"}',
        "POST /reset_prefix_cache",
        "POST /wake_up?tags=kv_cache",
        "GET /is_sleeping",
        "GET /health",
    ]


def test_vllm_level_1_wakes_whole_in_one_call():
    # The weights come back from host memory in the call that resumes scheduling: nothing to reload.
    recorder = Recorder()

    async def scenario():
        async with engine(recorder) as (client, url):
            calls = EngineSleep(client, url, "vllm")
            await calls.sleep(1)
            await calls.wake(1)

    run(scenario())
    assert recorder.calls == [
        "POST /sleep?level=1&mode=wait",
        "GET /is_sleeping",
        "POST /wake_up",
        "GET /is_sleeping",
        "GET /health",
    ]


@pytest.mark.parametrize("level", [1, 2])
def test_a_request_queued_during_the_sleep_runs_on_the_weights_reloaded(level):
    """Against the mock engine, which, as vLLM, runs what it holds as soon as it is fully awake, and answers a
    request run before a level-2 reload with NO_WEIGHTS words."""

    async def scenario():
        chat = {"model": "mock-small", "messages": [{"role": "user", "content": "still there"}]}
        async with serve(create_app("mock-small", dev_mode=True)) as (client, url):
            calls = EngineSleep(client, url, "vllm")
            await calls.sleep(level)
            queued = asyncio.create_task(client.post(url + "/v1/chat/completions", json=chat))
            await asyncio.sleep(0.2)
            assert not queued.done()
            await calls.wake(level)
            return (await queued).json()["choices"][0]["message"]["content"]

    answer = run(scenario())
    assert NO_WEIGHTS not in answer
    assert answer == "mock reply from mock-small: still there"


def test_sglang_releases_and_resumes_its_memory_and_a_follower_is_not_asked_anything():
    recorder = Recorder()

    async def scenario():
        async with engine(recorder) as (client, url):
            await EngineSleep(client, url, "sglang").sleep(1)
            await EngineSleep(client, url, "sglang").wake(1)
            await EngineSleep(client, url, "follower").sleep(2)
            await EngineSleep(client, url, "follower").wake(2)

    run(scenario())
    assert recorder.calls == [
        "POST /release_memory_occupation {}",
        "POST /resume_memory_occupation {}",
        "GET /health",
    ]


@pytest.mark.parametrize(
    ("answers", "step", "problem"),
    [
        ({"/sleep": (500, "engine core died")}, "sleep", "POST /sleep?level=1&mode=wait answered HTTP 500: engine core died"),
        ({"/is_sleeping": (200, '{"is_sleeping": false}')}, "sleep",
         "the engine answered POST /sleep?level=1 but says it is not sleeping"),
        ({"/is_sleeping": (200, "[]")}, "sleep", "GET /is_sleeping answered '[]', not {'is_sleeping': bool}"),
        ({"/is_sleeping": (200, json.dumps({"is_sleeping": True}))}, "wake",
         "the engine answered POST /wake_up but says it is still sleeping"),
        ({"/health": (503, "x" * 400)}, "wake", "GET /health answered HTTP 503: " + "x" * 300 + "…"),
        ({"/wake_up": (200, '{"status": "sleeping", "tags": null}')}, "wake",
         """POST /wake_up answered '{"status": "sleeping", "tags": null}', not status 'awake'"""),
        ({"/wake_up": (200, "")}, "wake", "POST /wake_up answered '', not status 'awake'"),
        # After level 2: an engine that resumed scheduling with the weights alone would run what it queued on
        # weights not reloaded yet; an engine that cannot empty its prefix cache would serve from stale blocks.
        ({"/wake_up?tags=weights": (200, '{"status": "awake", "tags": ["weights"]}')}, "wake 2",
         """POST /wake_up?tags=weights answered '{"status": "awake", "tags": ["weights"]}', not status """
         "'sleeping' (scheduling must stay paused until the weights are reloaded)"),
        ({"/collective_rpc": (500, "Internal Server Error")}, "wake 2",
         "POST /collective_rpc answered HTTP 500: Internal Server Error"),
        ({"/reset_prefix_cache": (200, '{"success": false}')}, "wake 2",
         """POST /reset_prefix_cache answered '{"success": false}', not success true"""),
        ({"/reset_prefix_cache": (200, "")}, "wake 2", "POST /reset_prefix_cache answered '', not success true"),
        ({"/wake_up?tags=kv_cache": (200, '{"status": "sleeping", "tags": ["kv_cache"]}')}, "wake 2",
         """POST /wake_up?tags=kv_cache answered '{"status": "sleeping", "tags": ["kv_cache"]}', not status """
         "'awake'"),
    ],
)  # fmt: skip
def test_each_failure_names_the_call_and_what_the_engine_answered(answers, step, problem):
    async def scenario():
        recorder = Recorder(answers)
        recorder.asleep = set(VLLM_MEMORY)
        async with engine(recorder) as (client, url):
            calls = EngineSleep(client, url, "vllm")
            with pytest.raises(EngineSleepError) as failed:
                await (calls.sleep(1) if step == "sleep" else calls.wake(2 if step == "wake 2" else 1))
            return str(failed.value)

    assert run(scenario()) == problem


def test_an_engine_that_does_not_answer_is_named_so():
    async def scenario():
        async with httpx.AsyncClient(trust_env=False) as client:
            with pytest.raises(EngineSleepError, match=r"^POST /wake_up failed: "):
                await EngineSleep(client, "http://127.0.0.1:9", "vllm").wake(1)

    run(scenario())


def test_levels_each_dialect_sleeps_at_and_unknown_dialects():
    assert level_problem("vllm", 2) is None and level_problem("follower", 2) is None
    assert level_problem("sglang", 2) == "a sglang engine sleeps at level 1 only, not level 2"

    async def build():
        async with httpx.AsyncClient(trust_env=False) as client:
            EngineSleep(client, "http://127.0.0.1:9", "llamacpp")

    with pytest.raises(ValueError, match="unknown sleep dialect 'llamacpp'"):
        run(build())
