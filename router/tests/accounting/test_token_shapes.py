"""Tokens counted through the router for Anthropic's Messages API and OpenAI's Responses API, whose answers count
`input_tokens` and `output_tokens` and always carry them: JSON answers and streams, every event relayed as sent.

The engine here answers as vLLM 0.32 does (its anthropic/serving.py and openai/responses/serving.py), and as
llama.cpp and SGLang do where they differ (a `message_delta` counting the output alone, cached input apart).
"""

import json

import httpx
import msgspec
import pytest
from aiohttp import web

from hub.credentials import hash_secret
from keys.models import ApiKey
from router.tests.conftest import MODEL, ThreadedEngine, make_table

pytestmark = pytest.mark.django_db(transaction=True)


def event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def message(usage: dict, **extra) -> dict:
    return {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": MODEL, **extra} | {
        "usage": usage
    }


# vLLM: message_start counts the prompt, message_delta the prompt again and the output.
VLLM_MESSAGE_EVENTS = [
    event("message_start", {"type": "message_start", "message": message({"input_tokens": 9, "output_tokens": 0})}),
    event("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}}),
    event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"text": 'usage: "{"'}}),
    event("content_block_stop", {"type": "content_block_stop", "index": 0}),
    event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
            "usage": {"input_tokens": 9, "output_tokens": 4},
        },
    ),
    event("message_stop", {"type": "message_stop"}),
]
# llama.cpp (SGLang alike): the cached part of the prompt apart, message_delta counting the output alone.
LLAMA_MESSAGE_EVENTS = [
    event(
        "message_start",
        {
            "type": "message_start",
            "message": message({"cache_read_input_tokens": 5, "input_tokens": 4, "output_tokens": 0}),
        },
    ),
    VLLM_MESSAGE_EVENTS[2],
    event(
        "message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}}
    ),
    VLLM_MESSAGE_EVENTS[-1],
]
RESPONSES_USAGE = {
    "input_tokens": 11,
    "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0, "input_tokens_per_turn": [11]},
    "output_tokens": 6,
    "output_tokens_details": {"reasoning_tokens": 0, "output_tokens_per_turn": [6]},
    "total_tokens": 17,
}


def response(usage, text: str = "hello") -> dict:
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]
    return {"id": "resp_1", "object": "response", "model": MODEL, "output": output, "usage": usage, "user": None}


def responses_events(text: str = "hello") -> list[bytes]:
    return [
        event("response.created", {"type": "response.created", "response": response(None, "")}),
        event("response.output_text.delta", {"type": "response.output_text.delta", "delta": text}),
        event("response.completed", {"type": "response.completed", "response": response(RESPONSES_USAGE, text)}),
    ]


class ShapesEngine(ThreadedEngine):
    """Answers /v1/messages (vLLM's shapes, llama.cpp's when the model field says so), its count_tokens, and
    /v1/responses; streams are written in pieces cut anywhere. Keeps the bodies it was sent."""

    def __init__(self):
        super().__init__("shapes")
        self.bodies: list[dict] = []
        self.sent: list[bytes] = []

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        app.router.add_post("/v1/responses", self._responses)

    async def _messages(self, request):
        body = await request.json()
        self.bodies.append(body)
        llama = body.get("metadata") == {"engine": "llama.cpp"}
        if body.get("stream"):
            return await self._stream(request, LLAMA_MESSAGE_EVENTS if llama else VLLM_MESSAGE_EVENTS)
        content = [{"type": "text", "text": "hi"}]
        usage = {"cache_read_input_tokens": 5, "input_tokens": 4, "output_tokens": 3} if llama else None
        return web.json_response(
            message(usage or {"input_tokens": 9, "output_tokens": 4}, content=content, stop_reason="max_tokens")
            | {"kv_transfer_params": None}
        )

    async def _count_tokens(self, request):
        self.bodies.append(await request.json())
        return web.json_response({"input_tokens": 9, "context_management": {"original_input_tokens": 9}})

    async def _responses(self, request):
        body = await request.json()
        self.bodies.append(body)
        text = "word " * 300_000 if body.get("input") == "long" else body.get("input", "hello")
        if body.get("stream"):
            return await self._stream(request, responses_events(text))
        return web.json_response(response(RESPONSES_USAGE, text))

    async def _stream(self, request, events: list[bytes]):
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        whole = b"".join(events)
        self.sent.append(whole)
        piece = 37 if len(whole) < 100_000 else 50_001  # pieces that cut events, and their usage objects, anywhere
        for at in range(0, len(whole), piece):
            await answer.write(whole[at : at + piece])
        await answer.write_eof()
        return answer


@pytest.fixture
def shapes_engine():
    engine = ShapesEngine().start()
    yield engine
    engine.stop()


@pytest.fixture
def router(start_router, hub, shapes_engine):
    hub.publish_endpoints(make_table([shapes_engine.url]))
    return start_router(flush_seconds=60)  # flushes far apart: the counts stay in the router for the test


def pending(router, api_key) -> list:
    """[requests, prompt, completion] counted for `api_key`'s model, not yet flushed."""
    counts, _ = router.state.ledger.tokens.pending()
    return msgspec.to_builtins(counts[hash_secret(api_key)][MODEL])[:3]  # its spend: test_budget_router.py


def post(router, auth, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{router.url}{path}", headers=auth, json={"model": MODEL, **body}, timeout=10)


def stream(router, auth, path: str, body: dict) -> bytes:
    with httpx.stream(
        "POST", f"{router.url}{path}", headers=auth, json={"model": MODEL, "stream": True, **body}, timeout=10
    ) as answer:
        assert answer.status_code == 200
        return answer.read()


ASK = {"max_tokens": 4, "messages": [{"role": "user", "content": "one two three"}]}


def test_a_messages_answer_counts_its_input_and_output_tokens(router, auth, api_key):
    answer = post(router, auth, "/v1/messages", ASK)
    assert answer.status_code == 200 and answer.json()["usage"] == {"input_tokens": 9, "output_tokens": 4}
    assert pending(router, api_key) == [1, 9, 4]
    # llama.cpp's (and Anthropic's) input_tokens leave the cached part of the prompt out: it counts too.
    post(router, auth, "/v1/messages", {**ASK, "metadata": {"engine": "llama.cpp"}})
    assert pending(router, api_key) == [2, 9 + 9, 4 + 3]


def test_a_messages_stream_is_counted_and_relayed_byte_for_byte_without_asking_for_usage(
    router, auth, api_key, shapes_engine
):
    raw = stream(router, auth, "/v1/messages", ASK)
    assert raw == shapes_engine.sent[-1]  # message_delta (its stop_reason, its usage) included
    assert pending(router, api_key) == [1, 9, 4]
    assert "stream_options" not in shapes_engine.bodies[-1]
    # message_delta counting the output alone: the prompt is message_start's (its cached part included).
    raw = stream(router, auth, "/v1/messages", {**ASK, "metadata": {"engine": "llama.cpp"}})
    assert raw == shapes_engine.sent[-1]
    assert pending(router, api_key) == [2, 9 + 9, 4 + 3]


def test_a_responses_answer_and_stream_count_their_tokens_and_the_stream_passes_whole(
    router, auth, api_key, shapes_engine
):
    answer = post(router, auth, "/v1/responses", {"input": "hello"})
    assert answer.status_code == 200 and answer.json()["usage"]["total_tokens"] == 17
    assert pending(router, api_key) == [1, 11, 6]  # a Responses input_tokens includes its cached tokens
    raw = stream(router, auth, "/v1/responses", {"input": "hello"})
    assert raw == shapes_engine.sent[-1]
    assert "stream_options" not in shapes_engine.bodies[-1]
    assert pending(router, api_key) == [2, 22, 12]


def test_a_long_responses_answer_is_counted_whole_or_streamed(router, auth, api_key, shapes_engine):
    # The last event of a stream carries the whole answer before its usage: read by its tail if need be.
    answer = post(router, auth, "/v1/responses", {"input": "long"})
    assert answer.status_code == 200 and len(answer.content) > 1_500_000
    raw = stream(router, auth, "/v1/responses", {"input": "long"})
    assert raw == shapes_engine.sent[-1]
    assert pending(router, api_key) == [2, 22, 12]


def test_counting_tokens_generates_nothing_and_counts_none(router, auth, api_key):
    answer = post(router, auth, "/v1/messages/count_tokens", {"messages": ASK["messages"]})
    assert answer.json()["input_tokens"] == 9
    assert pending(router, api_key) == [1, 0, 0]


def test_a_key_out_of_tokens_is_refused_messages_too(router):
    _, key = ApiKey.issue("thrifty", tpm=20)  # 13 tokens an answer
    auth = {"Authorization": f"Bearer {key}"}
    codes = [post(router, auth, "/v1/messages", ASK).status_code for _ in range(3)]
    assert codes == [200, 200, 429]
