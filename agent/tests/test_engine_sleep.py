"""The sleep and wake calls of each engine dialect (agent/engine_sleep.py), against a recording HTTP server on
127.0.0.1 that answers as the engine would (the mock engine and the real vLLM are driven elsewhere:
test_agent_sleep.py, tests/test_e2e_vllm.py)."""

import contextlib
import json

import httpx
import pytest
from aiohttp import web

from agent.engine_sleep import EngineSleep, EngineSleepError, level_problem
from agent.tests.stand_ins import run


class Recorder:
    """An engine stand-in: records each call, answers from `answers` (path -> (status, body)), else 200."""

    def __init__(self, answers: dict | None = None):
        self.calls: list[str] = []
        self.answers = answers or {}
        self.sleeping = False

    async def handle(self, request: web.Request) -> web.Response:
        body = (await request.text()) or ""
        self.calls.append(f"{request.method} {request.path_qs}{' ' + body if body else ''}")
        if request.path in self.answers:
            status, text = self.answers[request.path]
            return web.Response(status=status, text=text)
        if request.path == "/sleep":
            self.sleeping = True
        elif request.path == "/wake_up":
            self.sleeping = False
        elif request.path == "/is_sleeping":
            return web.json_response({"is_sleeping": self.sleeping})
        return web.Response(status=200)


@contextlib.asynccontextmanager
async def engine(recorder: Recorder):
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", recorder.handle)
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


def test_vllm_level_2_wakes_reloading_the_weights_and_resetting_the_prefix_cache():
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
        "POST /wake_up",
        'POST /collective_rpc {"method":"reload_weights"}',
        "POST /reset_prefix_cache",
        "GET /is_sleeping",
        "GET /health",
    ]


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
    ],
)  # fmt: skip
def test_each_failure_names_the_call_and_what_the_engine_answered(answers, step, problem):
    async def scenario():
        async with engine(Recorder(answers)) as (client, url):
            calls = EngineSleep(client, url, "vllm")
            with pytest.raises(EngineSleepError) as failed:
                await (calls.sleep(1) if step == "sleep" else calls.wake(1))
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
