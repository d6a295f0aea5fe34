"""The HTTP around a proxied request: the headers an engine gets and the client gets back, and what a client
is told of an answer that broke off (the error event that ends a broken stream), and why it broke as the
metrics count it."""

from __future__ import annotations

import asyncio

import aiohttp

from router.endpoints.table import Endpoint
from router.errors import EngineEndedUnfinished, ReplicaLeaving, RouterError, error_body
from router.forwarding.asgi_io import Scope

# Headers of an engine's response that mean the same thing to our client; hop-by-hop ones are not copied.
PASSED_RESPONSE_HEADERS = frozenset({b"content-type", b"content-length", b"content-encoding", b"cache-control"})
RETRIABLE_STATUSES = frozenset({502, 503})
REPLICA_HEADER = b"x-llmgw-replica"
QUEUE_WAIT_HEADER = b"x-llmgw-queue-seconds"
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
# A non-streamed answer up to this size is read whole before it is relayed, so a break is still an error status.
WHOLE_BODY_LIMIT = 4 * 1024 * 1024
SSE_DONE = b"data: [DONE]\n\n"
# The error code of an answer an engine broke off after it began.
UPSTREAM_FAILED = "upstream_failed"


def sse_error_event(message: str, code: str) -> bytes:
    """An OpenAI error event and the end of the stream: the SDKs raise APIError on `data: {"error": ...}`."""
    return b"data: " + error_body(message, "server_error", code) + b"\n\n" + SSE_DONE


# Why an answer broke (the `reason` label of llmgw_router_stream_continuations_total).
LOST = "engine_lost"  # the connection reset or closed
SILENT = "engine_silent"  # no next chunk within LLMGW_UPSTREAM_IDLE_SECONDS
ABORTED = "engine_aborted"  # the engine ended the answer unfinished: an error event, or finish_reason abort/error
LEAVING = "replica_leaving"  # the control plane asked for the stream to move off its replica (a drain or a sleep)


def break_reason(exc: BaseException) -> str:
    """Why an answer broke, as the metric says it: the engine lost, silent past a deadline (the sweep's
    cancellation, or a 504 for no first byte or a whole answer unread in time), ending the answer unfinished
    itself (also as the cause of a whole answer's 502), or its replica leaving service."""
    if isinstance(exc, EngineEndedUnfinished) or isinstance(exc.__cause__, EngineEndedUnfinished):
        return ABORTED
    if isinstance(exc, ReplicaLeaving):
        return LEAVING
    silent = isinstance(exc, TimeoutError | asyncio.CancelledError) or (
        isinstance(exc, RouterError) and exc.status == 504
    )
    return SILENT if silent else LOST


def break_message(endpoint: Endpoint, exc: BaseException, idle_timeout: float) -> tuple[int, str]:
    """(status, text) for an answer that broke after it began (`exc`: a cancellation by the sweep of
    requests in flight when its deadline passed), naming the deadline if one passed."""
    if isinstance(exc, TimeoutError | asyncio.CancelledError):
        return 504, (
            f"Replica {endpoint.replica_id} of `{endpoint.model}` sent nothing for {idle_timeout:g} s "
            "(LLMGW_UPSTREAM_IDLE_SECONDS) in the middle of its answer; the answer is incomplete."
        )
    if isinstance(exc, ReplicaLeaving):
        return 503, (
            f"Replica {endpoint.replica_id} of `{endpoint.model}` left service (a drain or a sleep) in the middle "
            "of its answer and no other replica could go on with it; the answer is incomplete."
        )
    if isinstance(exc, EngineEndedUnfinished):
        return 502, (
            f"Replica {endpoint.replica_id} of `{endpoint.model}` ended its answer unfinished ({exc}); "
            "the answer is incomplete."
        )
    return 502, (
        f"Replica {endpoint.replica_id} of `{endpoint.model}` failed in the middle of its answer "
        f"({type(exc).__name__}); the answer is incomplete."
    )


def response_headers(
    response: aiohttp.ClientResponse, endpoint: Endpoint, queue_wait: bytes | None, *, without_length: bool = False
) -> list[tuple[bytes, bytes]]:
    """The engine's response headers the client gets, as it sent them, which replica answered, and how long the
    request waited in the router's fair queue (`queue_wait`, seconds; None: it did not)."""
    skipped = b"content-length" if without_length else b""
    headers = []
    for name, value in response.raw_headers:  # a loop, not a comprehension: a frame less per answer
        lower = name.lower()
        if lower in PASSED_RESPONSE_HEADERS and lower != skipped:
            headers.append((lower, value))
    headers.append((REPLICA_HEADER, endpoint.replica_id_bytes))
    if queue_wait is not None:
        headers.append((QUEUE_WAIT_HEADER, queue_wait))
    return headers


def upstream_headers(scope: Scope) -> dict[str, str]:
    """The request headers an engine gets: JSON, the client's Accept, its request id and its trace context.

    The client's Accept-Encoding is not passed on: an answer the engine compressed could not be read for its
    token usage, nor its usage event dropped from a stream, so engines are asked for the answer as it is.
    """
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
    for name, value in scope["headers"]:
        if name == b"accept":
            headers["Accept"] = value.decode("latin-1")
        elif name == b"x-request-id":
            headers["X-Request-Id"] = value.decode("latin-1")
        elif name in (b"traceparent", b"tracestate"):
            # W3C trace context: the engine's spans join the client's trace (router.forwarding.tracing, when on, names
            # the router's own span as the parent instead).
            headers[name.decode()] = value.decode("latin-1")
    return headers
