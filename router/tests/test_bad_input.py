"""Bad input is a 400 in OpenAI's shape, never a 500; the other JSON endpoints are proxied; other paths are 404.

The property test drives the router app in-process (ASGI, on one event loop
with the app started) with generated bodies and headers, and fails on any
status of 500 or more, an exception out of the app, or a logged traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mockengine.generation import EXTRA_ENDPOINTS
from router.app import create_app
from router.config import RouterConfig
from router.errors import RouterError
from router.forwarding.body import MAX_JSON_DEPTH, decode_object, nesting_depth_exceeds
from router.forwarding.paths import PROXY_PATHS
from router.tests.conftest import ALIAS, MODEL, ThreadedEngine, make_table
from router.tests.forwarding.test_proxy import assert_openai_error

pytestmark = pytest.mark.django_db(transaction=True)


def post(router, headers, content: bytes, path="/v1/chat/completions"):
    return httpx.post(f"{router.url}{path}", headers=headers, content=content, timeout=10)


@pytest.mark.parametrize(
    ("body", "code", "mentions"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json", f"more than {MAX_JSON_DEPTH} levels deep"),
        (b"[" * 100_000, "invalid_json", f"more than {MAX_JSON_DEPTH} levels deep"),
        (b'{"model": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}", "invalid_json", "levels deep"),
        (b"null", "invalid_body", "must be a JSON object, not null"),
        (b"42", "invalid_body", "not number"),
        (b'"model"', "invalid_body", "not string"),
        (b"true", "invalid_body", "not boolean"),
        (b"", "invalid_json", "not valid JSON"),
        (b'{"model": "\xff\xfe"}', "invalid_json", "not valid UTF-8: byte 0xff at position 11"),
        (b'{"model": "x", "n": ' + b"9" * 5000 + b"}", "invalid_json", "not valid JSON"),
        (b"{}", "missing_model", '"model" is missing'),
        (b'{"model": null}', "missing_model", '"model" is null'),
        (b'{"model": 7}', "missing_model", "must be a string, not number"),
        (b'{"model": ["a"]}', "missing_model", "must be a string, not array"),
        (b'{"model": ""}', "missing_model", "must not be empty"),
    ],
)
def test_each_kind_of_bad_body_is_a_400_that_names_the_problem(start_router, hub, auth, body, code, mentions):
    hub.publish_endpoints(make_table())
    router = start_router()
    error = assert_openai_error(post(router, auth, body), 400, code, mentions)
    assert "NoneType" not in error["message"] and "RecursionError" not in error["message"]


def test_a_body_over_the_size_bound_is_413_in_openai_shape(start_router, auth):
    router = start_router(max_body_bytes=1000)
    assert_openai_error(post(router, auth, b"{" + b" " * 2000 + b"}"), 413, "body_too_large", "1000 bytes")


def test_an_unknown_long_model_name_is_quoted_back_bounded(start_router, hub, auth):
    hub.publish_endpoints(make_table())
    router = start_router()
    error = assert_openai_error(
        post(router, auth, json.dumps({"model": "m" * 10_000}).encode()), 404, "model_not_found"
    )
    assert len(error["message"]) < 300


def test_depth_is_measured_outside_strings_and_exactly_at_the_bound():
    def nested(depth: int) -> bytes:
        return b"[" * depth + b"]" * depth

    assert not nesting_depth_exceeds(nested(MAX_JSON_DEPTH))
    assert nesting_depth_exceeds(nested(MAX_JSON_DEPTH + 1))
    assert not nesting_depth_exceeds(json.dumps({"s": "[" * 10_000, "t": '\\"[[['}).encode())
    assert not nesting_depth_exceeds(json.dumps({"wide": [[1, 2]] * 10_000}).encode())
    assert nesting_depth_exceeds(json.dumps({"deep": json.loads(nested(MAX_JSON_DEPTH))}).encode())


# -- other endpoints and paths -------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXTRA_ENDPOINTS)
def test_other_json_endpoints_naming_a_model_are_proxied_to_its_replica(start_router, hub, auth, engine_process, path):
    engine = engine_process()
    hub.publish_endpoints(make_table([engine.url]))
    router = start_router()
    response = httpx.post(f"{router.url}{path}", headers=auth, json={"model": ALIAS, "query": "q"}, timeout=5)
    assert response.status_code == 200
    assert response.json() == {"object": "mock.receipt", "model": MODEL, "path": path}
    assert response.headers["x-llmgw-replica"] == "1"


class EchoEngine(ThreadedEngine):
    """Answers a POST to any path with the path and the model its body names, as an engine serving it would."""

    def __init__(self):
        super().__init__("echo")
        self.paths: list[str] = []

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/{path:.*}", self._echo)

    async def _echo(self, request):
        self.paths.append(request.path)
        body = await request.json()
        return web.json_response({"object": "echo", "model": body["model"], "path": request.path})


@pytest.fixture
def echo_engine():
    engine = EchoEngine().start()
    yield engine
    engine.stop()


# Paths one of the engines serves with a body that names the model, which the router once answered 404.
ADDED_PATHS = [
    "/v1/messages",  # Anthropic: vLLM, SGLang, llama.cpp
    "/v1/messages/count_tokens",
    "/v1/chat/completions/batch",  # vLLM: `messages` is a list of conversations, `model` at the top
    "/v2/embed",
    "/generative_scoring",
    "/v1/systemone",  # vLLM and SGLang
    "/v1/decisions",  # SGLang
    "/chat/completions",  # llama.cpp
    "/responses",
    "/v1/chat/completions/input_tokens",
    "/chat/completions/input_tokens",
    "/v1/responses/input_tokens",
    "/responses/input_tokens",
    "/v1/reranking",
    "/reranking",
]
# OpenAI's, but no engine llmgw runs serves them: the router's own 404, the engine never asked.
DROPPED_PATHS = ["/v1/moderations", "/v1/audio/speech"]


@pytest.mark.parametrize("path", ADDED_PATHS)
def test_each_engine_path_naming_a_model_is_proxied_to_a_replica_of_it(start_router, hub, auth, echo_engine, path):
    hub.publish_endpoints(make_table([echo_engine.url]))
    router = start_router()
    response = httpx.post(f"{router.url}{path}", headers=auth, json={"model": ALIAS, "messages": []}, timeout=5)
    assert response.status_code == 200, response.text
    assert response.json() == {"object": "echo", "model": MODEL, "path": path}
    assert response.headers["x-llmgw-replica"] == "1"


@pytest.mark.parametrize("path", DROPPED_PATHS)
def test_a_path_no_engine_serves_is_the_routers_404(start_router, hub, auth, echo_engine, path):
    hub.publish_endpoints(make_table([echo_engine.url]))
    router = start_router()
    response = httpx.post(f"{router.url}{path}", headers=auth, json={"model": MODEL, "input": "x"}, timeout=5)
    assert_openai_error(response, 404, "not_found", f"Unknown path: POST {path}")
    assert echo_engine.paths == []


def test_every_proxied_path_checks_the_key_and_the_model(start_router, hub, auth):
    hub.publish_endpoints(make_table())
    router = start_router()
    for path in sorted(PROXY_PATHS):
        assert_openai_error(httpx.post(f"{router.url}{path}", json={"model": MODEL}), 401, "invalid_api_key")
        assert_openai_error(post(router, auth, b'{"model": "gpt-17"}', path), 404, "model_not_found", "gpt-17")


@pytest.mark.parametrize(
    ("method", "path"), [("POST", "/v1/files"), ("GET", "/v1"), ("POST", "/v1/chat"), ("GET", "/")]
)
def test_any_other_path_is_404_in_openai_shape(start_router, auth, method, path):
    router = start_router()
    response = httpx.request(method, f"{router.url}{path}", headers=auth)
    assert_openai_error(response, 404, "not_found", path)


# -- generated input --------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
)
models = st.sampled_from([MODEL, ALIAS, "", "nope"]) | json_values
objects = st.fixed_dictionaries({}, optional={"model": models, "stream": json_values, "messages": json_values})
bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    objects.map(lambda v: json.dumps(v).encode()),
    st.builds(
        lambda d, a: (b"[" if a else b'{"a":') * d + (b"]" if a else b"}") * d,
        st.sampled_from([1, 128, 129, 2000, 100_000]) | st.integers(0, 3000),
        st.booleans(),
    ),
    st.builds(lambda raw, cut: raw[:cut], objects.map(lambda v: json.dumps(v).encode()), st.integers(0, 60)),
)
# What an HTTP/1.1 server hands an app: lowercase token names; values of visible ASCII, space, tab, obs-text.
header_names = st.sampled_from(
    [b"authorization", b"accept", b"accept-encoding", b"x-request-id", b"content-type", b"x-other"]
)
header_values = st.binary(max_size=40).map(lambda b: bytes(c for c in b if c == 9 or 32 <= c != 127))
paths = st.sampled_from(sorted(PROXY_PATHS) + ["/v1/models", "/health", "/nope", "/v1/chat/completions/x"])


@pytest.fixture
def in_process_router(hub, api_key, start_engine):
    """A started router app driven without a server, on an event loop of the test's own."""
    hub.publish_endpoints(make_table([start_engine().url]))
    app = create_app(
        hub, RouterConfig.from_settings(activation_timeout=0, poll_seconds=30, flush_seconds=30, keepalive_seconds=0)
    )
    loop = asyncio.new_event_loop()
    loop.run_until_complete(app.state.start())
    yield app, loop, api_key
    loop.run_until_complete(app.state.stop())
    loop.close()


async def call(app, method: str, path: str, headers: list, body: bytes) -> tuple[int, dict, bytes]:
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b""}
    sent: list[dict] = []
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(30)  # the client stays until the answer is complete
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), 10)
    assert sent and sent[0]["type"] == "http.response.start"
    return sent[0]["status"], dict(sent[0]["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT"]),
    path=paths,
    headers=st.lists(st.tuples(header_names, header_values), max_size=4),
    with_key=st.booleans(),
    body=bodies,
)
# The body that was a RecursionError 500 before depth was bounded.
@example(method="POST", path="/v1/chat/completions", headers=[], with_key=True, body=b"[" * 100_000 + b"]" * 100_000)
def test_no_generated_request_is_a_500_or_logs_a_traceback(
    in_process_router, caplog, method, path, headers, with_key, body
):
    app, loop, api_key = in_process_router
    if with_key:
        headers = [*headers, (b"authorization", f"Bearer {api_key}".encode())]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        status, answer_headers, answer = loop.run_until_complete(call(app, method, path, headers, body))
    assert status < 500 or status in (502, 503, 504), (status, answer)
    if status >= 400 and b"x-llmgw-replica" not in answer_headers:
        # The router's own answer (not an engine's, relayed): OpenAI's error shape.
        assert set(json.loads(answer)["error"]) == {"message", "type", "param", "code"}
    assert not [r for r in caplog.records if r.exc_info or (r.levelno >= logging.ERROR and not leftover(r))]


def leftover(record: logging.LogRecord) -> bool:
    """asyncio's note of a pending task garbage-collected now: another test's server, not this request (a task of
    this request that failed would carry its exception)."""
    return record.name == "asyncio" and record.getMessage().startswith("Task was destroyed but it is pending")


# -- the fast decoder changes no answer ------------------------------------------------------------

_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=8), _JSON_VALUES, max_size=6))
def test_bodies_decode_to_what_the_json_module_reads(payload):
    body = json.dumps(payload).encode()
    assert decode_object(body) == json.loads(body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "temperature": NaN}',  # the json module's extension: accepted as before
        b'{"model": "m", "x": "\\ud800"}',  # a lone surrogate
        b'{"model": "m", "n": 1e999}',  # a float out of range reads as infinity
        b'{"model": "m", "n": 18446744073709551616000}',  # past 64 bits
        b'{"model": "a", "model": "b"}',  # the last of a repeated key wins
    ],
)
def test_what_the_fast_decoder_refuses_is_read_as_the_json_module_reads_it(body):
    assert repr(decode_object(body)) == repr(json.loads(body))


@pytest.mark.parametrize(
    "body, message",
    [
        (b"\xff{}", "The request body is not valid UTF-8: byte 0xff at position 0."),
        (b'{"model": "m"', "The request body is not valid JSON: Expecting ',' delimiter: line 1 column 14 (char 13)"),
        (b"[1]", "The request body must be a JSON object, not array."),
    ],
)
def test_bad_bodies_are_named_as_before(body, message):
    with pytest.raises(RouterError) as caught:
        decode_object(body)
    assert caught.value.message == message


@pytest.mark.parametrize("max_waiters", [0, -1])
def test_a_router_that_could_hold_no_cold_start_request_is_refused_as_its_cold_start_refuses_it(max_waiters):
    # One rule for the bound on waiters (coldstart.MIN_WAITERS): the router's configuration refuses what its
    # cold start would, instead of taking 0 and failing later.
    with pytest.raises(ValueError, match="max_waiters must be >= 1"):
        RouterConfig.from_settings(max_waiters=max_waiters)
