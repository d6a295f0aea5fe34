"""Failures handled like a gateway: each upstream deadline, answers that break after they began, bounded waiters.

The engines here are tiny aiohttp servers (or bare sockets) that fail on cue:
stall before their headers, go silent or die between chunks, cut a body short.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from aiohttp import web

from conftest import wait_until
from router.tests.conftest import MODEL, ThreadedEngine, make_table
from router.tests.forwarding.test_proxy import assert_openai_error, chat, metric, run_concurrently, stream_lines

pytestmark = pytest.mark.django_db(transaction=True)


def chunk(text: str) -> bytes:
    data = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    data["choices"] = [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
    return f"data: {json.dumps(data)}\n\n".encode()


class BrokenEngine(ThreadedEngine):
    """An engine that begins its answer and then fails as `mode` says.

    Modes: "stall" (first chunk, then silence), "die" (first chunk, then the
    connection is cut), "short" (a JSON body cut short of its Content-Length),
    "short_stall" (part of a JSON body, then silence), "slow_start" (headers
    only after `delay` seconds, then a whole answer).
    """

    shutdown_timeout = 0.1

    def __init__(self, mode: str, delay: float = 0.0):
        super().__init__(f"broken-{mode}")
        self.mode = mode
        self.delay = delay
        self.requests = 0
        self.done = threading.Event()  # set when the engine's handler ended (the router hung up on it)

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._answer)

    async def _answer(self, request):
        self.requests += 1
        await request.read()
        try:
            if self.mode == "slow_start":
                await asyncio.sleep(self.delay)
                return web.json_response({"id": "x", "object": "chat.completion", "model": MODEL, "choices": []})
            if self.mode in ("short", "short_stall"):
                response = web.StreamResponse(headers={"Content-Type": "application/json"})
                response.content_length = 100
                await response.prepare(request)
                await response.write(b'{"id": "x", "object": ')
                if self.mode == "short":
                    request.transport.close()
                else:
                    await self._until_hung_up(request)
                return response
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(chunk("Hello"))
            if self.mode == "die":
                request.transport.abort()
            else:
                await self._until_hung_up(request)
            return response
        finally:
            self.done.set()

    @staticmethod
    async def _until_hung_up(request) -> None:
        """Stay silent until the client (the router) closes the connection, or 10 s."""
        for _ in range(200):
            if request.transport is None or request.transport.is_closing():
                return
            await asyncio.sleep(0.05)


@pytest.fixture
def broken_engine():
    started: list[BrokenEngine] = []

    def start(mode: str, **kwargs) -> BrokenEngine:
        engine = BrokenEngine(mode, **kwargs).start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


# -- connect ---------------------------------------------------------------------------------------


@pytest.fixture
def unanswered_port():
    """A port whose connect never completes: a listener with a full backlog that never accepts."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    # Fill the accept queue; later SYNs are dropped, so a connect just hangs.
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(listener.getsockname())
        fillers.append(filler)
    time.sleep(0.05)
    yield listener.getsockname()[1]
    for sock in (*fillers, listener):
        sock.close()


def test_a_connect_past_its_deadline_is_retried_on_another_replica(
    start_router, hub, auth, start_engine, unanswered_port
):
    live = start_engine("live")
    stalled = f"http://127.0.0.1:{unanswered_port}"
    hub.publish_endpoints(make_table([{"url": stalled, "priority": 1}, {"url": live.url, "priority": 0}]))
    router = start_router(connect_timeout=0.3, first_byte_timeout=5)
    started = time.monotonic()
    response = chat(router, auth)
    assert (response.status_code, response.headers["x-llmgw-replica"]) == (200, "2")
    assert 0.3 <= time.monotonic() - started < 3
    assert metric(router, f'llmgw_router_retries_total{{model="{MODEL}"}}') == 1


# -- first byte ------------------------------------------------------------------------------------


def test_no_first_byte_within_its_deadline_is_504_naming_that_deadline(start_router, hub, auth, broken_engine):
    slow = broken_engine("slow_start", delay=2.0)
    hub.publish_endpoints(make_table([slow.url]))
    router = start_router(first_byte_timeout=0.3, idle_timeout=5)
    started = time.monotonic()
    error = assert_openai_error(chat(router, auth), 504, "upstream_timeout", "LLMGW_UPSTREAM_FIRST_BYTE_SECONDS")
    assert error["type"] == "server_error"
    assert time.monotonic() - started < 1.5
    assert slow.requests == 1  # not sent again: the engine may be working on it
    wait_until(lambda: router.state.ledger.in_flight() == 0)


def test_a_first_byte_slower_than_the_idle_deadline_is_still_waited_for(start_router, hub, auth, broken_engine):
    """The two deadlines are separate: the idle one does not apply before the answer begins."""
    slow = broken_engine("slow_start", delay=0.6)
    hub.publish_endpoints(make_table([slow.url]))
    router = start_router(first_byte_timeout=5, idle_timeout=0.2)
    response = chat(router, auth)
    assert response.status_code == 200
    assert response.json()["object"] == "chat.completion"


# -- between chunks ---------------------------------------------------------------------------------


def test_a_stream_silent_past_the_idle_deadline_ends_with_an_error_event_and_done(
    start_router, hub, auth, broken_engine
):
    stalled = broken_engine("stall")
    hub.publish_endpoints(make_table([stalled.url]))
    router = start_router(first_byte_timeout=5, idle_timeout=0.3)
    status, lines = stream_lines(router, auth)
    assert status == 200
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["delta"]["content"] == "Hello"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert (error["code"], error["type"]) == ("upstream_failed", "server_error")
    assert "LLMGW_UPSTREAM_IDLE_SECONDS" in error["message"]
    assert lines[-1] == "data: [DONE]"
    assert stalled.done.wait(3)  # the upstream connection was closed
    wait_until(lambda: router.state.ledger.in_flight() == 0)


def test_the_openai_sdk_raises_on_a_stream_whose_engine_dies_and_does_not_hang(
    start_router, hub, api_key, broken_engine
):
    dying = broken_engine("die")
    hub.publish_endpoints(make_table([dying.url]))
    # Not continued (router.tests.forwarding.test_continuation): a continuation would wait for another replica.
    router = start_router(stream_migrations=0)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=api_key, max_retries=0, timeout=5)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    received = []
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="failed in the middle of its answer") as raised:
        for event in stream:
            received.append(event.choices[0].delta.content)
    assert time.monotonic() - started < 3
    assert received == ["Hello"]
    assert raised.value.body["code"] == "upstream_failed"
    assert metric(router, f'llmgw_router_requests_total{{code="502",model="{MODEL}"}}') == 1


def test_the_async_openai_sdk_raises_on_a_stream_silent_past_the_idle_deadline(
    start_router, hub, api_key, broken_engine
):
    hub.publish_endpoints(make_table([broken_engine("stall").url]))
    router = start_router(idle_timeout=0.3)

    async def consume():
        client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key=api_key, max_retries=0, timeout=5)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for _ in stream:
            pass

    with pytest.raises(openai.APIError, match="sent nothing for 0.3 s"):
        asyncio.run(consume())


def test_a_whole_answer_cut_short_is_502_in_openai_shape(start_router, hub, auth, broken_engine):
    hub.publish_endpoints(make_table([broken_engine("short").url]))
    router = start_router()
    response = chat(router, auth)
    error = assert_openai_error(response, 502, "upstream_failed", "failed in the middle of its answer")
    assert error["type"] == "server_error"
    wait_until(lambda: router.state.ledger.in_flight() == 0)


@pytest.mark.parametrize("mode", ["short", "short_stall"])
def test_a_whole_answer_cut_before_it_was_sent_is_asked_of_another_replica(
    start_router, hub, auth, broken_engine, start_engine, mode
):
    broken, live = broken_engine(mode), start_engine("live")
    hub.publish_endpoints(make_table([{"url": broken.url, "priority": 1}, {"url": live.url, "priority": 0}]))
    router = start_router(idle_timeout=0.3)
    response = chat(router, auth)
    assert response.status_code == 200 and response.json()["object"] == "chat.completion"
    assert (broken.requests, response.headers["x-llmgw-replica"]) == (1, "2")
    reason = "engine_lost" if mode == "short" else "engine_silent"
    labels = f'model="{MODEL}",outcome="resent_whole",reason="{reason}"'
    assert metric(router, f"llmgw_router_stream_continuations_total{{{labels}}}") == 1


def test_a_whole_answer_is_not_asked_again_when_continuations_are_off(
    start_router, hub, auth, broken_engine, start_engine
):
    broken, live = broken_engine("short"), start_engine("live")
    hub.publish_endpoints(make_table([{"url": broken.url, "priority": 1}, {"url": live.url, "priority": 0}]))
    router = start_router(stream_migrations=0)
    assert chat(router, auth).status_code == 502


def test_a_whole_answer_that_stalls_midway_is_504_naming_the_idle_deadline(start_router, hub, auth, broken_engine):
    hub.publish_endpoints(make_table([broken_engine("short_stall").url]))
    router = start_router(idle_timeout=0.3)
    assert_openai_error(chat(router, auth), 504, "upstream_failed", "LLMGW_UPSTREAM_IDLE_SECONDS")


# -- waiters -----------------------------------------------------------------------------------------


def test_waiters_per_model_are_bounded_and_the_next_one_is_503_with_retry_after(start_router, hub, auth, start_engine):
    hub.publish_endpoints(make_table())  # known, nothing runs it
    router = start_router(activation_timeout=5, max_waiters=2, retry_after=9)
    engine = start_engine("cold")
    results: list = []
    waiters = threading.Thread(target=lambda: results.extend(run_concurrently(router, auth, 2)))
    waiters.start()
    wait_until(lambda: router.state.cold_start.waiting(MODEL) == 2)

    refused = chat(router, auth)
    error = assert_openai_error(refused, 503, "too_many_waiting", "LLMGW_MAX_WAITERS_PER_MODEL")
    assert error["type"] == "server_error"
    assert refused.headers["retry-after"] == "9"

    hub.publish_endpoints(make_table([engine.url]))
    waiters.join(10)
    assert [status for status, _ in results] == [200, 200]
    assert router.state.cold_start.waiting(MODEL) == 0
    assert chat(router, auth).status_code == 200


def test_a_streaming_waiter_past_the_bound_gets_the_refusal_in_its_stream(start_router, hub, auth):
    hub.publish_endpoints(make_table())
    router = start_router(activation_timeout=1.5, max_waiters=1, keepalive_seconds=0.1)
    held: list = []
    holder = threading.Thread(target=lambda: held.append(chat(router, auth)))
    holder.start()
    wait_until(lambda: router.state.cold_start.waiting(MODEL) == 1)
    status, lines = stream_lines(router, auth)
    assert status == 200  # committed to a stream before the wait began
    assert json.loads(lines[-1].removeprefix("data: "))["error"]["code"] == "too_many_waiting"
    holder.join(5)
    assert held[0].status_code == 503 and held[0].json()["error"]["code"] == "model_starting"


def test_the_health_of_a_draining_router_is_503_and_new_requests_are_refused(start_router, hub, auth, start_engine):
    hub.publish_endpoints(make_table([start_engine().url]))
    router = start_router()
    assert chat(router, auth).status_code == 200
    router.state.begin_drain()
    response = chat(router, auth)
    assert_openai_error(response, 503, "shutting_down", "shutting down")
    assert response.headers["connection"] == "close"
    assert httpx.get(f"{router.url}/health").status_code == 503
    assert httpx.get(f"{router.url}/metrics").status_code == 200


def test_a_stream_silent_past_the_idle_deadline_goes_on_from_another_replica(
    start_router, hub, auth, broken_engine, engine_process
):
    stalled, greedy = broken_engine("stall"), engine_process(args=("--greedy",))
    hub.publish_endpoints(make_table([{"url": stalled.url, "priority": 1}, {"url": greedy.url, "priority": 0}]))
    router = start_router(idle_timeout=0.3)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 6}
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", headers=auth, json=body, timeout=10) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    # The stalled replica said "Hello" (no token ids): the rest follows that text, five tokens more.
    texts = [e["choices"][0]["delta"].get("content") for e in events if e["choices"]]
    assert texts[0] == "Hello" and len([t for t in texts[1:] if t]) == 5
    assert not any("error" in e for e in events)
    labels = f'model="{MODEL}",outcome="continued",reason="engine_silent"'
    assert metric(router, f"llmgw_router_stream_continuations_total{{{labels}}}") == 1
    assert stalled.done.wait(3)  # its connection was closed
