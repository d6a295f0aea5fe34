"""Token accounting in the router: usage read from answers (JSON and streams), counted per key and model, flushed."""

import asyncio
import json
import threading

import httpx
import msgspec
import pytest
from aiohttp import web

from conftest import free_port, wait_until
from hub import InProcessHub
from hub.contracts import TokenCount, hour_of
from hub.credentials import hash_secret
from router.accounting.counter import TokenCounter
from router.accounting.flusher import UsageFlusher
from router.accounting.usage_reader import (
    IN_OUT_SSE_CARRY_BYTES,
    IN_OUT_USAGE_PATHS,
    JSON_TAIL_BYTES,
    WHOLE_DECODE_BYTES,
    InOutJsonUsage,
    InOutSseUsage,
    JsonUsage,
    SseUsage,
    ask_for_usage,
    usage_in_json_tail,
    usage_of_whole_answer,
    usage_reader,
)
from router.metrics import RouterMetrics
from router.tests.accounting.test_usage import UnreachableRedisHub
from router.tests.conftest import MODEL, ThreadedEngine, make_table, new_picker

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "one two three"}]


# -- reading usage, without a network ------------------------------------------------------


def test_a_stream_that_did_not_ask_for_usage_asks_for_it_and_the_option_is_last():
    body, pass_usage = ask_for_usage(b'{"model": "m", "stream": true}  ')
    assert pass_usage is False
    assert json.loads(body) == {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
    assert body.endswith(b'"stream_options":{"include_usage":true}}')


def test_a_client_asking_for_usage_is_forwarded_unchanged_and_gets_the_chunk():
    original = b'{"model": "m", "stream": true, "stream_options": {"include_usage": true}}'
    assert ask_for_usage(original) == (original, True)


def test_other_stream_options_of_the_client_are_kept_when_usage_is_added():
    body, pass_usage = ask_for_usage(b'{"model": "m", "stream": true, "stream_options": {"continuous": 1}}')
    assert pass_usage is False
    assert json.loads(body)["stream_options"] == {"continuous": 1, "include_usage": True}
    body, pass_usage = ask_for_usage(b'{"model": "m", "stream": true, "stream_options": {"include_usage": false}}')
    assert (pass_usage, json.loads(body)["stream_options"]) == (False, {"include_usage": True})


def test_stream_options_that_are_not_an_object_are_left_for_the_engine_to_refuse():
    original = b'{"model": "m", "stream": true, "stream_options": "yes"}'
    assert ask_for_usage(original) == (original, True)


def test_json_usage_is_read_from_the_tail_and_embeddings_have_no_completion_tokens():
    chat = b'{"choices": [{"text": "the \\"usage\\": {} word"}], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}'
    assert usage_in_json_tail(chat) == (7, 3)
    assert usage_in_json_tail(b'{"data": [], "usage": {"prompt_tokens": 5, "total_tokens": 5}}') == (5, 0)
    assert usage_in_json_tail(b'{"data": [], "usage": {"prompt_tokens": 5, "completion_tokens": null}}') == (5, 0)
    assert usage_in_json_tail(b'{"usage":{"prompt_tokens":5,"completion_tokens":1}}') == (5, 1)  # no spaces
    assert usage_in_json_tail(b'{"usage" :\n {"prompt_tokens": 5}, "x": {"usage": null}}') == (5, 0)


def test_a_whole_answer_is_read_only_when_it_is_uncompressed_json():
    body = b'{"usage": {"prompt_tokens": 7, "completion_tokens": 3}}'
    assert usage_of_whole_answer("application/json; charset=utf-8", "", body) == (7, 3)
    assert usage_of_whole_answer("application/json", "identity", body) == (7, 3)
    assert usage_of_whole_answer("application/json", "gzip", body) is None
    assert usage_of_whole_answer("text/plain", "", body) is None
    # A long answer: only the tail is looked at, so a usage object further from the end than that is not found.
    assert usage_of_whole_answer("application/json", "", body + b" " * WHOLE_DECODE_BYTES) == (7, 3)
    assert usage_of_whole_answer("application/json", "", body + b" " * JSON_TAIL_BYTES) is None


@pytest.mark.parametrize("padding", [0, WHOLE_DECODE_BYTES], ids=["short, decoded whole", "long, by its tail"])
@pytest.mark.parametrize(
    "answer, expected",
    [
        (
            b'{"choices": [{"text": "a \\"usage\\": {} b"}], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}',
            (7, 3),
        ),
        (b'{"data": [], "usage": {"prompt_tokens": 5, "total_tokens": 5}}', (5, 0)),
        (b'{"usage": {"prompt_tokens": 5, "completion_tokens": null}}', (5, 0)),
        (
            b'{"usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 1}, "completion_tokens": 2}}',
            (3, 2),
        ),
        (b'{"usage": {"prompt_tokens": "7", "completion_tokens": 3}}', None),
        (b'{"usage": {"prompt_tokens": 7, "completion_tokens": -1}}', None),
        (b'{"usage": {"prompt_tokens": true}}', None),
        (b'{"usage": null}', None),
        (b'{"choices": []}', None),
        (b'{"usage": {"prompt_tokens": 7, "completion_tokens": 3', None),
    ],
)
def test_a_whole_answer_reads_the_same_usage_short_or_long(answer, expected, padding):
    # JSON allows whitespace anywhere between tokens: the same answer made long enough to be read by its tail.
    body = answer[:1] + b" " * padding + answer[1:]
    assert usage_of_whole_answer("application/json", "", body) == expected


@pytest.mark.parametrize(
    "body",
    [
        b'{"usage": {"prompt_tokens": "7", "completion_tokens": 3}}',
        b'{"usage": {"prompt_tokens": 7, "completion_tokens": 3.0}}',
        b'{"usage": {"prompt_tokens": 7, "completion_tokens": 1099511627777}}',
        b'{"usage": {"prompt_tokens": -1, "completion_tokens": 3}}',
        b'{"usage": {"prompt_tokens": true, "completion_tokens": 3}}',
        b'{"usage": {"completion_tokens": 3}}',
        b'{"usage": {"prompt_tokens": 7, "completion_tokens": 3',
        b'{"usage": null}',
        b'{"choices": []}',
        b"not json at all",
    ],
)
def test_malformed_or_missing_usage_reads_as_none(body):
    reader = JsonUsage()
    assert reader.feed(body) == body
    assert reader.usage() is None


def test_json_usage_keeps_only_a_bounded_tail_of_a_long_answer():
    reader = JsonUsage()
    filler = b"x" * 1000
    for _ in range(3 * JSON_TAIL_BYTES // 1000):
        reader.feed(filler)
    reader.feed(b'"usage": {"prompt_tokens": 1, "completion_tokens": 2}}')
    assert reader._size < JSON_TAIL_BYTES + 2000
    assert reader.usage() == (1, 2)


def sse(payload) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


CONTENT = sse({"choices": [{"delta": {"content": "hi"}}], "usage": None})
USAGE = sse({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}})
DONE = b"data: [DONE]\n\n"


def relay(reader: SseUsage, chunks) -> bytes:
    return b"".join(reader.feed(chunk) for chunk in chunks) + reader.finish()


def test_the_usage_event_is_read_and_dropped_when_the_client_did_not_ask():
    reader = SseUsage(pass_usage=False)
    assert relay(reader, [CONTENT, CONTENT + USAGE, DONE]) == CONTENT + CONTENT + DONE
    assert reader.usage() == (4, 2)


def test_the_usage_event_passes_unchanged_when_the_client_asked():
    reader = SseUsage(pass_usage=True)
    assert relay(reader, [CONTENT, USAGE, DONE]) == CONTENT + USAGE + DONE
    assert reader.usage() == (4, 2)


def test_a_usage_event_split_across_chunks_anywhere_is_still_read_and_dropped():
    whole = CONTENT + USAGE + DONE
    for cut in range(1, len(whole)):
        reader = SseUsage(pass_usage=False)
        assert relay(reader, [whole[:cut], whole[cut:]]) == CONTENT + DONE, cut
        assert reader.usage() == (4, 2)


def test_complete_events_pass_at_once_and_only_an_unfinished_one_waits():
    reader = SseUsage(pass_usage=False)
    assert reader.feed(CONTENT + CONTENT[:10]) == CONTENT
    assert reader.feed(CONTENT[10:]) == CONTENT


def test_a_usage_on_a_content_chunk_is_counted_but_never_dropped():
    event = sse({"choices": [{"delta": {"content": "!"}}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    reader = SseUsage(pass_usage=False)
    assert relay(reader, [event, DONE]) == event + DONE
    assert reader.usage() == (1, 1)


def test_a_malformed_usage_event_counts_nothing_and_passes():
    event = b'data: {"choices": [], "usage": {"prompt_tokens": "many"}}\n\n'
    reader = SseUsage(pass_usage=False)
    assert relay(reader, [CONTENT, event, DONE]) == CONTENT + event + DONE
    assert reader.usage() is None


def test_crlf_framed_events_are_read_too():
    usage = USAGE.replace(b"\n\n", b"\r\n\r\n")
    reader = SseUsage(pass_usage=False)
    assert relay(reader, [CONTENT, usage, DONE]) == CONTENT + DONE
    assert reader.usage() == (4, 2)


# -- Anthropic's Messages API and OpenAI's Responses API: input and output tokens, always sent ---------------


def named_event(kind: str, payload) -> bytes:
    return f"event: {kind}\n".encode() + sse(payload)


ANTHROPIC_JSON = (
    b'{"id":"msg_1","type":"message","role":"assistant","content":[{"type":"text","text":"hi"}],"model":"m",'
    b'"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":9,"output_tokens":4},'
    b'"kv_transfer_params":null}'
)
RESPONSES_USAGE = {
    "input_tokens": 11,
    "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0, "input_tokens_per_turn": [11]},
    "output_tokens": 6,
    "output_tokens_details": {"reasoning_tokens": 0, "output_tokens_per_turn": [6]},
    "total_tokens": 17,
}
RESPONSES_JSON = json.dumps(
    {"id": "r", "object": "response", "output": [], "usage": RESPONSES_USAGE, "user": None, "metrics": None}
).encode()
MESSAGE_START = named_event(
    "message_start", {"type": "message_start", "message": {"id": "m", "content": [], "usage": {"input_tokens": 9}}}
)
TEXT_DELTA = named_event("content_block_delta", {"type": "content_block_delta", "delta": {"text": '"usage": {'}})
MESSAGE_DELTA = named_event(
    "message_delta",
    {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"input_tokens": 9, "output_tokens": 4}},
)
MESSAGE_STOP = named_event("message_stop", {"type": "message_stop"})


@pytest.mark.parametrize("padding", [0, WHOLE_DECODE_BYTES], ids=["short, decoded whole", "long, by its tail"])
@pytest.mark.parametrize(
    "answer, expected",
    [
        (ANTHROPIC_JSON, (9, 4)),
        # Anthropic's input_tokens leave the prompt's cached tokens out (llama.cpp, SGLang): they are prompt too.
        (b'{"usage": {"cache_read_input_tokens": 5, "input_tokens": 4, "output_tokens": 3}}', (9, 3)),
        (b'{"usage": {"input_tokens": 4, "cache_creation_input_tokens": 2, "cache_read_input_tokens": null}}', (6, 0)),
        # A Responses usage: its input_tokens include the cached ones of its details.
        (RESPONSES_JSON, (11, 6)),
        (b'{"usage": {"input_tokens": -1, "output_tokens": 3}}', None),
        (b'{"usage": {"input_tokens": "9", "output_tokens": 3}}', None),
        (b'{"usage": {"total_tokens": 3}}', None),
        (b'{"usage": null}', None),
        # Token counting generates nothing and has no usage.
        (b'{"input_tokens": 9, "context_management": {"original_input_tokens": 9}}', None),
    ],
)
def test_an_in_out_answer_counts_input_and_output_tokens_short_or_long(answer, expected, padding):
    body = answer[:1] + b" " * padding + answer[1:]
    for path in IN_OUT_USAGE_PATHS:
        assert usage_of_whole_answer("application/json", "", body, path) == expected
        reader = usage_reader("application/json", "", True, path)
        assert isinstance(reader, InOutJsonUsage) and reader.feed(body) == body
        assert reader.usage() == expected
    # OpenAI's chat shape is read as before, and an in/out usage is none of its.
    assert usage_of_whole_answer("application/json", "", body, "/v1/chat/completions") is None
    assert usage_of_whole_answer("application/json", "", body, "/v1/messages/count_tokens") is None


def test_only_the_in_out_paths_get_the_in_out_readers():
    assert {"/v1/messages", "/v1/responses", "/responses"} == IN_OUT_USAGE_PATHS
    assert type(usage_reader("text/event-stream", "", False, "/v1/messages")) is InOutSseUsage
    assert type(usage_reader("text/event-stream", "", False, "/v1/chat/completions")) is SseUsage
    assert type(usage_reader("application/json", "", True, "/v1/completions")) is JsonUsage
    assert usage_reader("text/event-stream", "gzip", True, "/v1/messages") is None


def test_an_anthropic_stream_counts_the_last_input_and_output_and_passes_every_byte():
    whole = MESSAGE_START + TEXT_DELTA + MESSAGE_DELTA + MESSAGE_STOP
    reader = InOutSseUsage()
    assert reader.drops is False
    assert relay(reader, [whole]) == whole
    assert reader.usage() == (9, 4)
    for cut in range(1, len(whole)):
        reader = InOutSseUsage()
        assert relay(reader, [whole[:cut], whole[cut:]]) == whole, cut
        assert reader.usage() == (9, 4), cut


def test_a_message_delta_counting_the_output_alone_keeps_message_start_s_input():
    # llama.cpp and SGLang: message_start counts the input (cached apart), message_delta the output alone.
    start = named_event(
        "message_start",
        {"type": "message_start", "message": {"usage": {"cache_read_input_tokens": 5, "input_tokens": 4}}},
    )
    delta = named_event("message_delta", {"type": "message_delta", "usage": {"output_tokens": 3}})
    reader = InOutSseUsage()
    assert relay(reader, [start, TEXT_DELTA, delta, MESSAGE_STOP]) == start + TEXT_DELTA + delta + MESSAGE_STOP
    assert reader.usage() == (9, 3)
    # A stream cut before its message_delta has counted its input.
    reader = InOutSseUsage()
    relay(reader, [start, TEXT_DELTA])
    assert reader.usage() == (9, 0)


def test_a_responses_stream_counts_its_last_event_s_response_usage():
    created = named_event("response.created", {"type": "response.created", "response": {"usage": None}})
    completed = named_event(
        "response.completed", {"type": "response.completed", "response": json.loads(RESPONSES_JSON)}
    )
    reader = InOutSseUsage()
    assert relay(reader, [created, completed[:50], completed[50:]]) == created + completed
    assert reader.usage() == (11, 6)


@pytest.mark.parametrize("size", [IN_OUT_SSE_CARRY_BYTES // 2, IN_OUT_SSE_CARRY_BYTES * 2], ids=["held", "too long"])
def test_a_responses_event_carrying_a_long_answer_before_its_usage_is_still_counted(size):
    answer = {"output": [{"content": [{"text": "x" * size}]}], "usage": RESPONSES_USAGE, "user": None}
    completed = named_event("response.completed", {"type": "response.completed", "response": answer})
    reader = InOutSseUsage()
    piece = 64 * 1024
    assert relay(reader, [completed[at : at + piece] for at in range(0, len(completed), piece)]) == completed
    assert reader.usage() == (11, 6)


def test_malformed_in_out_usage_counts_nothing_and_passes():
    bad = named_event("message_delta", {"type": "message_delta", "usage": {"output_tokens": -4}})
    odd = named_event("error", {"type": "error", "message": "not an object", "usage": {"output_tokens": 1}})
    reader = InOutSseUsage()
    assert relay(reader, [MESSAGE_START, bad, odd]) == MESSAGE_START + bad + odd
    assert reader.usage() == (9, 0)


def test_counts_add_up_per_key_and_model_and_a_failed_answer_counts_only_last_use():
    clock = iter([10.0, 11.0, 12.0, 13.0])
    counter = TokenCounter(clock=lambda: next(clock))
    counter.count("k1", "m", (3, 4), served=True)
    counter.count("k1", "m", None, served=True)
    counter.count("k1", "n", (1, 0), served=True)
    counter.count("k2", "m", (9, 9), served=False)
    counts, last_use = counter.take()
    assert counts == {
        "k1": {"m": TokenCount(requests=2, prompt=3, completion=4), "n": TokenCount(requests=1, prompt=1, completion=0)}
    }
    assert last_use == {"k1": 12.0, "k2": 13.0}
    assert counter.take() == ({}, {})


def test_restored_counts_add_to_new_ones_and_the_newer_last_use_wins():
    counter = TokenCounter(clock=lambda: 50.0)
    counter.count("k", "m", (1, 1), served=True)
    counter.restore({"k": {"m": TokenCount(requests=2, prompt=5, completion=6)}}, {"k": 40.0})
    assert counter.take() == ({"k": {"m": TokenCount(requests=3, prompt=6, completion=7)}}, {"k": 50.0})


# -- through the router, against the bundled mock engine -------------------------------------------


def stream_body(router, auth, **extra) -> bytes:
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, **extra}
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", headers=auth, json=body, timeout=10) as response:
        assert response.status_code == 200
        assert "content-length" not in response.headers
        return response.read()


def events(raw: bytes) -> list:
    return [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]


@pytest.fixture
def mock_router(start_router, hub, engine_process):
    hub.publish_endpoints(make_table([engine_process().url]))
    # Flushes far apart: the counts stay in the router for the test to read.
    return start_router(flush_seconds=60)


def pending(router, api_key) -> list:
    """[requests, prompt, completion] counted for `api_key`'s model, not yet flushed."""
    counts, last_use = router.state.ledger.tokens.pending()
    assert hash_secret(api_key) in last_use
    return msgspec.to_builtins(counts[hash_secret(api_key)][MODEL])[:3]  # its spend: test_budget_router.py


def test_a_non_streamed_answer_is_counted_from_its_usage(mock_router, auth, api_key):
    response = httpx.post(
        f"{mock_router.url}/v1/chat/completions", headers=auth, json={"model": MODEL, "messages": MESSAGES}
    )
    usage = response.json()["usage"]
    assert pending(mock_router, api_key) == [1, usage["prompt_tokens"], usage["completion_tokens"]]


def test_a_stream_is_counted_and_its_usage_chunk_dropped_when_the_client_did_not_ask(mock_router, auth, api_key):
    raw = stream_body(mock_router, auth)
    assert raw.endswith(b"data: [DONE]\n\n")
    chunks = events(raw)
    assert chunks and all(chunk["choices"] for chunk in chunks)
    completion = sum(1 for chunk in chunks if chunk["choices"][0]["delta"].get("content"))
    assert pending(mock_router, api_key) == [1, 3, completion]


def test_a_stream_that_asked_for_usage_gets_the_chunk_and_is_counted_once(mock_router, auth, api_key):
    raw = stream_body(mock_router, auth, stream_options={"include_usage": True})
    last = events(raw)[-1]
    assert last["choices"] == []
    assert pending(mock_router, api_key) == [1, last["usage"]["prompt_tokens"], last["usage"]["completion_tokens"]]


def test_embeddings_count_their_prompt_tokens(mock_router, auth, api_key):
    response = httpx.post(
        f"{mock_router.url}/v1/embeddings", headers=auth, json={"model": MODEL, "input": ["a b", "c d e"]}
    )
    assert response.status_code == 200
    assert pending(mock_router, api_key) == [1, 5, 0]


def test_requests_and_tokens_add_up_across_answers(mock_router, auth, api_key):
    for _ in range(3):
        httpx.post(f"{mock_router.url}/v1/embeddings", headers=auth, json={"model": MODEL, "input": "a b"})
    stream_body(mock_router, auth)
    requests, prompt, _ = pending(mock_router, api_key)
    assert (requests, prompt) == (4, 3 * 2 + 3)


@pytest.fixture
def malformed_usage_engine():
    """An engine (aiohttp, on a thread of its own) whose answers carry a usage that is not one."""

    async def chat(request):
        return web.json_response({"choices": [], "usage": {"prompt_tokens": "lots"}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="malformed-engine")
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_a_malformed_usage_counts_no_tokens_and_never_fails_the_request(
    start_router, hub, api_key, auth, malformed_usage_engine
):
    hub.publish_endpoints(make_table([malformed_usage_engine]))
    router = start_router(flush_seconds=60)
    response = httpx.post(
        f"{router.url}/v1/chat/completions", headers=auth, json={"model": MODEL, "messages": MESSAGES}
    )
    assert response.status_code == 200
    assert pending(router, api_key) == [1, 0, 0]


# -- flushing ------------------------------------------------------------------------------------


def test_tokens_reach_the_hub_with_the_usage_report_and_add_up_across_flushes(
    start_router, hub, auth, api_key, start_engine
):
    hub.publish_endpoints(make_table([start_engine().url]))
    router = start_router(flush_seconds=0.1)
    for _ in range(2):
        response = httpx.post(
            f"{router.url}/v1/chat/completions", headers=auth, json={"model": MODEL, "messages": MESSAGES}
        )
        assert response.status_code == 200
        # Flushed: each flush adds to the hub's counters, which only the tick takes.
        wait_until(lambda: router.state.ledger.tokens.pending() == ({}, {}))
    snapshot = hub.collect_usage()
    digest = hash_secret(api_key)
    # The fake engine's answers carry 1 prompt and 3 completion tokens.
    assert msgspec.to_builtins(snapshot.tokens) == {hour_of(snapshot.keys[digest]): {digest: {MODEL: [2, 2, 6, 0]}}}
    assert hub.collect_usage().tokens == {}


def test_a_failed_flush_keeps_the_counts_for_the_next(tmp_path):
    picker = new_picker()
    picker.ledger.tokens.count("k", MODEL, (3, 4), served=True)
    down = UnreachableRedisHub(make_table())
    flusher = UsageFlusher(down, picker.ledger, RouterMetrics(), flush_seconds=1, router_id="r")
    assert asyncio.run(flusher.flush()) is False
    assert picker.ledger.tokens.pending()[0] == {"k": {MODEL: TokenCount(requests=1, prompt=3, completion=4)}}
    picker.ledger.tokens.count("k", MODEL, (1, 1), served=True)
    working = InProcessHub()
    flusher.hub = working
    assert asyncio.run(flusher.flush()) is True
    assert picker.ledger.tokens.pending() == ({}, {})
    assert list(working.collect_usage().tokens.values()) == [
        {"k": {MODEL: TokenCount(requests=2, prompt=4, completion=5)}}
    ]


@pytest.mark.parametrize(
    "tail, expected",
    [
        (b'{"x": 1, "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}', (3, 2)),
        # Nested details, a brace inside a string, and a "usage" inside a string after the real one.
        (
            b'{"usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 1}, "completion_tokens": 2}}',
            (3, 2),
        ),
        (b'{"usage": {"prompt_tokens": 3, "note": "a}b", "completion_tokens": 2}}', (3, 2)),
        (b'{"usage": {"prompt_tokens": 4, "completion_tokens": 1}, "echo": "\\"usage\\" here"}', (4, 1)),
        (b'{"usage": {"prompt_tokens": 3,', None),  # cut short
        (b'{"choices": []}', None),
    ],
)
def test_the_usage_of_a_json_answer_is_read_from_its_tail(tail, expected):
    assert usage_in_json_tail(tail) == expected


# -- compression ---------------------------------------------------------------------------------


class CompressingEngine(ThreadedEngine):
    """An engine that compresses its answers whenever the request accepts it, as one behind a compressing
    front end would; its answers carry usage (a whole answer's, or a stream's last event)."""

    def __init__(self):
        super().__init__("compressing")
        self.accept_encodings: list[str] = []

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)

    async def _chat(self, request):
        body = await request.json()
        self.accept_encodings.append(request.headers.get("Accept-Encoding", ""))
        usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
        if not body.get("stream"):
            response = web.json_response({"choices": [{"index": 0, "message": {"content": "hi"}}], "usage": usage})
            response.enable_compression()  # negotiated from the request's Accept-Encoding
            return response
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        response.enable_compression()
        await response.prepare(request)
        content = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
        for event in (content, {"choices": [], "usage": usage}):
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
def compressing_engine():
    engine = CompressingEngine().start()
    yield engine
    engine.stop()


def test_answers_are_counted_and_the_usage_event_dropped_when_the_client_accepts_compression(
    start_router, hub, api_key, auth, compressing_engine
):
    hub.publish_endpoints(make_table([compressing_engine.url]))
    router = start_router(flush_seconds=60)
    headers = {**auth, "Accept-Encoding": "gzip, deflate, br"}
    url = f"{router.url}/v1/chat/completions"
    whole = httpx.post(url, headers=headers, json={"model": MODEL, "messages": MESSAGES})
    assert whole.status_code == 200 and whole.json()["usage"]["prompt_tokens"] == 7
    with httpx.stream("POST", url, headers=headers, json={"model": MODEL, "messages": MESSAGES, "stream": True}) as s:
        raw = s.read()
    # Counted twice, and the usage event the client did not ask for is gone from the stream.
    assert pending(router, api_key) == [2, 14, 4]
    assert [e["choices"] != [] for e in events(raw)] == [True]
    # The engine was asked for answers as they are, whatever the client accepts.
    assert compressing_engine.accept_encodings == ["identity", "identity"]


def test_an_answers_tokens_count_against_the_replica_that_served_it(mock_router, auth, api_key):
    """The showback's shares: each answer's prompt and completion tokens, per replica and key."""
    usage = httpx.post(
        f"{mock_router.url}/v1/chat/completions", headers=auth, json={"model": MODEL, "messages": MESSAGES}
    ).json()["usage"]
    httpx.post(f"{mock_router.url}/v1/chat/completions", headers=auth, json={"model": MODEL, "messages": MESSAGES})
    tokens = mock_router.state.ledger.tokens
    assert tokens.take_replicas() == {"1": {hash_secret(api_key): 2 * usage["total_tokens"]}}
    assert tokens.take_replicas() == {}
