"""Forwarding one request to an engine replica and relaying its answer.

One aiohttp ClientSession (opened at router start-up) carries every upstream
request. Per-phase deadlines only, never an overall one, so a stream runs as
long as the engine keeps sending: connecting (a refused or slow connect is
retried on another replica), the first byte of the answer (then 504: the
engine may be working on it, so it is not sent again), and silence between
chunks once the answer has begun. A request is retried once on another
replica, but only before any byte reached the client; a client that goes away
closes the upstream connection, which is what makes the engine stop
generating. How each attempt ended before its response began goes to the
balancer, which ejects replicas that keep failing.

An answer that breaks after it began never becomes a 500 or a bare cut where
avoidable: a stream (SSE) ends with an OpenAI error event and `[DONE]`, which
the OpenAI SDKs raise as an APIError; a whole answer of known, bounded length
is read before anything is sent, so its failure is still a 502/504 in
OpenAI's shape; only a large or unbounded non-SSE body can still be cut.

Each answer's token usage is read as it is relayed and counted per key and
model (router.tokens).
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from .asgi_io import Scope, Send
from .balancer import Balancer
from .coldstart import ColdStart
from .ejection import Failure
from .errors import RouterError
from .inflight import FIRST_BYTE, NEXT_CHUNK, Exchange
from .metrics import RouterMetrics
from .table import Endpoint
from .tokens import ask_for_usage, usage_of_whole_answer, usage_reader
from .wire import (
    RETRIABLE_STATUSES,
    SSE_HEADERS,
    WHOLE_BODY_LIMIT,
    response_headers,
    sse_error_event,
    upstream_headers,
)

log = logging.getLogger(__name__)


class Proxy:
    """Sends requests to a replica of their model (waiting for a cold start if need be) and relays the answer."""

    def __init__(
        self,
        balancer: Balancer,
        metrics: RouterMetrics,
        cold_start: ColdStart,
        *,
        connect_timeout: float,
        first_byte_timeout: float,
        idle_timeout: float,
    ):
        if connect_timeout <= 0 or first_byte_timeout <= 0 or idle_timeout <= 0:
            raise ValueError("connect_timeout, first_byte_timeout and idle_timeout must be > 0")
        self.balancer = balancer
        self.metrics = metrics
        self.cold_start = cold_start
        self.first_byte_timeout = first_byte_timeout
        self.idle_timeout = idle_timeout
        # Per-phase deadlines only: a stream may run as long as the engine keeps sending. aiohttp keeps
        # the connect deadline; the first byte's and the next chunk's are the sweep's (router.inflight).
        self.timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_read=None)
        self.session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        """Open the upstream session (on the router's loop)."""
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0,
                # Below uvicorn's 5 s keep-alive, so we rarely reuse a connection the engine is closing.
                keepalive_timeout=4.0,
            ),
            timeout=self.timeout,
            # Bytes go to the client as the engine sent them; Accept-Encoding is the client's own.
            auto_decompress=False,
            # A cookie an engine sets is for its client: never kept here and sent along with other requests.
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def forward(
        self,
        scope: Scope,
        send: Send,
        path: str,
        model: str,
        body: bytes,
        exchange: Exchange,
        streaming: bool = False,
        *,
        affinity: int | None = None,
        pools: frozenset[str] | None = None,
    ) -> None:
        """Answer the request from a replica of `model`; a RouterError if none can (before the response began).

        `affinity` and `pools` go to every pick of the request (Balancer.pick)."""
        if self.session is None:
            raise RouterError(503, "The router is not started.", "router_not_started", type_="server_error")
        cold_start = self.cold_start
        # A stream's tokens come only in a usage chunk the engine sends when asked (router.tokens).
        body, pass_usage = ask_for_usage(body) if streaming else (body, True)
        endpoint = self.balancer.pick(model, (), affinity, pools)
        if endpoint is None and streaming and cold_start.keepalive_seconds > 0:
            # Answer at once and keep the stream alive while the model starts. From here on an
            # error can only travel inside the stream, as an OpenAI error event.
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            exchange.status = 200
            try:
                endpoint = await cold_start.wait_with_keepalives(send, model, affinity, pools)
                await self._send_upstream(
                    scope,
                    send,
                    path,
                    model,
                    body,
                    exchange,
                    endpoint,
                    headers_sent=True,
                    affinity=affinity,
                    pools=pools,
                    pass_usage=pass_usage,
                )
            except RouterError as exc:
                exchange.status = exc.status
                await send({"type": "http.response.body", "body": b"data: " + exc.body() + b"\n\n", "more_body": False})
            return
        if endpoint is None:
            endpoint = await cold_start.wait_for_endpoint(model, (), affinity, pools)
            if endpoint is None:
                raise cold_start.starting_error(model)
        await self._send_upstream(
            scope,
            send,
            path,
            model,
            body,
            exchange,
            endpoint,
            headers_sent=False,
            affinity=affinity,
            pools=pools,
            pass_usage=pass_usage,
        )

    async def _send_upstream(
        self,
        scope: Scope,
        send: Send,
        path: str,
        model: str,
        body: bytes,
        exchange: Exchange,
        endpoint: Endpoint,
        *,
        headers_sent: bool,
        affinity: int | None = None,
        pools: frozenset[str] | None = None,
        pass_usage: bool = True,
    ) -> None:
        """Send the request to `endpoint` (retrying once on another replica before any upstream byte
        is relayed) and relay the answer."""
        session, balancer, metrics = self.session, self.balancer, self.metrics
        assert session is not None  # forward() refuses to start without one
        headers = upstream_headers(scope)
        tried: list[Endpoint] = []
        held = False
        failure: Failure | None
        error: aiohttp.ClientError
        while True:
            tried.append(endpoint)
            retry_possible = len(tried) == 1
            # The engine owes the first byte from now (router.inflight); a retry has a deadline of its own.
            exchange.phase, exchange.since = FIRST_BYTE, None
            try:
                started = time.perf_counter()
                response = await session.post(endpoint.url + path, data=body, headers=headers)
            except (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError) as exc:
                failure, error = Failure.CONNECT, exc
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                failure, error = Failure.LOST, exc
            except asyncio.CancelledError:
                if exchange.deadline_passed() is None:
                    balancer.release(endpoint)
                    raise
                # Not retried: the engine accepted the request and may be working on it.
                balancer.release(endpoint, Failure.LOST)
                raise RouterError(
                    504,
                    f"Replica {endpoint.replica_id} of `{model}` did not answer in time: no first byte within "
                    f"{self.first_byte_timeout:g} s (LLMGW_UPSTREAM_FIRST_BYTE_SECONDS).",
                    "upstream_timeout",
                    type_="server_error",
                ) from None
            except BaseException:
                balancer.release(endpoint)
                raise
            else:
                failure = None
            if failure is not None:
                # Nothing reached the client yet: count the failure (it may eject the replica) and retry once.
                exchange.phase = None  # a hold for a replacement below is not the engine's to answer
                balancer.release(endpoint, failure)
                log.warning("replica %s of %s failed before responding: %r", endpoint.replica_id, model, error)
                nxt = balancer.pick(model, tried, affinity, pools) if retry_possible else None
                if nxt is None and failure is Failure.CONNECT and not headers_sent and not held:
                    # Nothing accepted the connection and no other replica is left: the model's engines
                    # (or their node) are gone. Hold the request as for a cold start until the control
                    # plane publishes a replacement, rather than failing it; once per request.
                    held = True
                    nxt = await self.cold_start.wait_for_endpoint(model, tried, affinity, pools)
                    if nxt is None:
                        raise self.cold_start.starting_error(model)
                if nxt is None:
                    raise RouterError(
                        502, f"No replica of `{model}` could be reached.", "upstream_unavailable", type_="server_error"
                    ) from None
                metrics.retries.labels(model).inc()
                endpoint = nxt
                continue
            metrics.traffic.upstream_latency(model, time.perf_counter() - started)
            exchange.phase = None  # the answer has begun; what it still owes is awaited below, each wait named
            status = response.status
            if status < 500:
                balancer.succeeded(endpoint)
            else:
                if status in RETRIABLE_STATUSES and retry_possible:
                    nxt = balancer.pick(model, tried, affinity, pools)
                    if nxt is not None:
                        response.close()
                        balancer.release(endpoint, Failure.ERROR)
                        metrics.retries.labels(model).inc()
                        endpoint = nxt
                        continue
                balancer.failed(endpoint, Failure.ERROR)
            if headers_sent and status != 200:
                # The client already has a 200 and a stream: carry the engine's error inside it.
                exchange.phase, exchange.since = NEXT_CHUNK, None
                try:
                    detail = (await response.content.read(64 * 1024)).decode("utf-8", "replace")
                except (aiohttp.ClientError, TimeoutError, asyncio.CancelledError) as exc:
                    if isinstance(exc, asyncio.CancelledError) and exchange.deadline_passed() is None:
                        raise
                    detail = f"(its body broke off: {type(exc).__name__})"
                finally:
                    response.close()
                    balancer.release(endpoint)
                raise RouterError(
                    status,
                    f"Replica {endpoint.replica_id} of `{model}` answered {status}: {detail}",
                    "upstream_error",
                    type_="server_error",
                )
            await self._relay(send, endpoint, response, exchange, headers_sent=headers_sent, pass_usage=pass_usage)
            return

    def _break_message(self, endpoint: Endpoint, exc: BaseException) -> tuple[int, str]:
        """(status, text) for an answer that broke after it began (`exc`: a cancellation by the sweep of
        requests in flight when its deadline passed), naming the deadline if one passed."""
        if isinstance(exc, TimeoutError | asyncio.CancelledError):
            return 504, (
                f"Replica {endpoint.replica_id} of `{endpoint.model}` sent nothing for {self.idle_timeout:g} s "
                "(LLMGW_UPSTREAM_IDLE_SECONDS) in the middle of its answer; the answer is incomplete."
            )
        return 502, (
            f"Replica {endpoint.replica_id} of `{endpoint.model}` failed in the middle of its answer "
            f"({type(exc).__name__}); the answer is incomplete."
        )

    async def _relay(
        self,
        send: Send,
        endpoint: Endpoint,
        response: aiohttp.ClientResponse,
        exchange: Exchange,
        *,
        headers_sent: bool = False,
        pass_usage: bool = True,
    ) -> None:
        """Relay the engine's answer: a stream chunk by chunk, a bounded whole answer in one piece.

        Never retried once started. A break mid-stream ends the stream with an error event.
        `pass_usage` False: the client did not ask for a stream's usage chunk, so it is read and dropped.
        """
        clean = False
        status = response.status
        reader = None
        usage = None
        engine_headers = response.headers
        # The header as sent, not `response.content_type`: that parses its parameters, which nothing here needs.
        content_type = engine_headers.get("Content-Type", "")
        counted = exchange.key is not None and 200 <= status < 300
        try:
            streamed = headers_sent or content_type.startswith("text/event-stream")
            length = response.content_length
            if not streamed and length is not None and length <= WHOLE_BODY_LIMIT:
                exchange.phase, exchange.since = NEXT_CHUNK, None
                try:
                    body = await response.read()
                except (aiohttp.ClientError, TimeoutError, asyncio.CancelledError) as exc:
                    if isinstance(exc, asyncio.CancelledError) and exchange.deadline_passed() is None:
                        raise
                    # Nothing was sent yet: the client still gets an error status.
                    status, message = self._break_message(endpoint, exc)
                    log.warning("%s (%r)", message, exc)
                    raise RouterError(status, message, "upstream_failed", type_="server_error") from None
                exchange.phase = None  # all read
                if counted:
                    # A whole JSON answer: its usage is read here; nothing of it is dropped.
                    usage = usage_of_whole_answer(content_type, engine_headers.get("Content-Encoding", ""), body)
                await send(
                    {
                        "type": "http.response.start",
                        "status": response.status,
                        "headers": response_headers(response, endpoint),
                    }
                )
                exchange.status = response.status
                await send({"type": "http.response.body", "body": body, "more_body": False})
                exchange.complete = clean = True
                return
            if counted:
                reader = usage_reader(content_type, engine_headers.get("Content-Encoding", ""), pass_usage)
            if not headers_sent:
                # A body that may lose its usage event cannot keep the engine's length.
                dropping = reader is not None and reader.drops
                await send(
                    {
                        "type": "http.response.start",
                        "status": response.status,
                        "headers": response_headers(response, endpoint, without_length=dropping),
                    }
                )
            exchange.status = response.status
            exchange.phase, exchange.since = NEXT_CHUNK, None
            try:
                async for chunk in response.content.iter_any():
                    if reader is not None:
                        chunk = reader.feed(chunk)
                        if not chunk:
                            exchange.since = None  # the engine sent something all the same
                            continue
                    exchange.phase = None  # while sending: a slow client's time is not the engine's silence
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    exchange.phase, exchange.since = NEXT_CHUNK, None
                exchange.phase = None
                if reader is not None and (rest := reader.finish()):
                    await send({"type": "http.response.body", "body": rest, "more_body": True})
            except (aiohttp.ClientError, TimeoutError, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError) and exchange.deadline_passed() is None:
                    raise
                status, message = self._break_message(endpoint, exc)
                log.warning("%s (%r)", message, exc)
                if not streamed:
                    # Too late for a status and a body of known length cannot be ended early: the client sees a cut.
                    return
                exchange.status = status
                await send({"type": "http.response.body", "body": sse_error_event(message, "upstream_failed")})
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            exchange.complete = True
            clean = True
        finally:
            if clean:
                response.release()
            else:
                # Closing (not pooling) the connection is what makes the engine stop generating.
                response.close()
            self.balancer.release(endpoint)
            if exchange.key is not None:
                if reader is not None:
                    usage = reader.usage()
                self.balancer.tokens.count(exchange.key, endpoint.model, usage, 200 <= status < 300)
                if usage is not None:
                    self.balancer.limits.spent_tokens(exchange.key, usage[0] + usage[1])
