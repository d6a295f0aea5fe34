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
model (router.accounting.usage_reader); a LoRA adapter's under the adapter's own name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_left
from dataclasses import dataclass, field

import aiohttp
from aiohttp import ClientResponse

from router.accounting.usage_reader import (
    IN_OUT_USAGE_PATHS,
    JsonUsage,
    SseUsage,
    ask_for_usage,
    usage_of_whole_answer,
    usage_reader,
)
from router.config import RouterConfig
from router.endpoints.table import Endpoint
from router.errors import RouterError
from router.forwarding.asgi_io import Scope, Send
from router.forwarding.coldstart import ColdStart
from router.forwarding.headers import (
    RETRIABLE_STATUSES,
    SSE_HEADERS,
    WHOLE_BODY_LIMIT,
    break_message,
    response_headers,
    sse_error_event,
    upstream_headers,
)
from router.forwarding.inflight import FIRST_BYTE, NEXT_CHUNK, Exchange
from router.metrics import RouterMetrics
from router.picking.affinity import Prefix
from router.picking.balancer import Balancer
from router.picking.ejection import Failure

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Forwarding:
    """One request on its way to a replica: what every attempt sends, and how far the request has got.

    `affinity` and `pools` go to every pick of the request (Balancer.pick).
    `pass_usage` False: the client did not ask for a stream's usage chunk, so
    it is read and dropped. `headers_sent`: the client already has a 200 and a
    stream (held through a cold start), so an error can only travel inside it.
    `received`: when the router received it (time.perf_counter), for a stream's time to first token.
    """

    scope: Scope
    send: Send
    path: str
    model: str
    body: bytes
    exchange: Exchange
    streaming: bool = False
    affinity: Prefix | None = None
    pools: frozenset[str] | None = None
    pass_usage: bool = True
    headers_sent: bool = False
    held: bool = False  # held once already for a replacement replica (see _replacement)
    received: float = 0.0
    tried: list[Endpoint] = field(default_factory=list)


class Proxy:
    """Sends requests to a replica of their model (waiting for a cold start if need be) and relays the answer."""

    def __init__(self, balancer: Balancer, metrics: RouterMetrics, cold_start: ColdStart, config: RouterConfig):
        self.balancer = balancer
        self.metrics = metrics
        self.cold_start = cold_start
        self.first_byte_timeout = config.first_byte_timeout
        self.idle_timeout = config.idle_timeout
        # Per-phase deadlines only: a stream may run as long as the engine keeps sending. aiohttp keeps
        # the connect deadline; the first byte's and the next chunk's are the sweep's (router.forwarding.inflight).
        self.timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout, sock_read=None)
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
        """Close the upstream session."""
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def forward(self, request: Forwarding) -> None:
        """Answer `request` from a replica of its model; a RouterError if none can (before the response began)."""
        if self.session is None:
            raise RouterError(503, "The router is not started.", "router_not_started", type_="server_error")
        if request.streaming and request.path not in IN_OUT_USAGE_PATHS:
            # An OpenAI stream's tokens come only in a usage chunk the engine sends when asked; Anthropic's and
            # the Responses API's streams always carry theirs (router.accounting.usage_reader).
            request.body, request.pass_usage = ask_for_usage(request.body)
        try:
            endpoint = self.balancer.pick(request.model, (), request.affinity, request.pools)
            if endpoint is None:
                endpoint = await self._wait_for_replica(request)
            await self._send_upstream(request, endpoint)
        except RouterError as exc:
            if not request.headers_sent:
                raise
            # The stream has begun: its error travels inside it, as an OpenAI error event.
            request.exchange.status = exc.status
            event = b"data: " + exc.body() + b"\n\n"
            await request.send({"type": "http.response.body", "body": event, "more_body": False})

    async def _wait_for_replica(self, request: Forwarding) -> Endpoint:
        """A replica of the request's model once one is ready (a cold start), or a RouterError.

        A stream is answered at once and kept alive while the model starts."""
        cold_start, model = self.cold_start, request.model
        if request.streaming and cold_start.keepalive_seconds > 0:
            await request.send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            request.exchange.status = 200
            request.headers_sent = True
            return await cold_start.wait_with_keepalives(request.send, model, request.affinity, request.pools)
        endpoint = await cold_start.wait_for_endpoint(model, (), request.affinity, request.pools)
        if endpoint is None:
            raise cold_start.starting_error(model)
        return endpoint

    async def _send_upstream(self, request: Forwarding, endpoint: Endpoint) -> None:
        """Send the request to `endpoint` (once more to another replica if it fails before answering); relay it."""
        session, balancer, exchange = self.session, self.balancer, request.exchange
        assert session is not None  # forward() refuses to start without one
        headers = self._upstream_headers(request)
        failure: Failure
        error: aiohttp.ClientError
        while True:
            request.tried.append(endpoint)
            # The engine owes the first byte from now (router.forwarding.inflight); a retry has a deadline of its own.
            exchange.wait(FIRST_BYTE)
            try:
                started = time.perf_counter()
                sent = headers if endpoint.authorization is None else headers | endpoint.authorization  # its own key
                response = await session.post(endpoint.url + request.path, data=request.body, headers=sent)
            except (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError) as exc:
                failure, error = Failure.CONNECT, exc
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                failure, error = Failure.LOST, exc
            except asyncio.CancelledError as exc:
                if not exchange.engine_failed(exc):
                    balancer.release(endpoint, None, request.model)
                    raise
                # Not retried: the engine accepted the request and may be working on it.
                balancer.release(endpoint, Failure.LOST, request.model)
                raise self._first_byte_overdue(request, endpoint) from None
            except BaseException:
                balancer.release(endpoint, None, request.model)
                raise
            else:
                self.metrics.traffic.upstream_latency(request.model, time.perf_counter() - started)
                exchange.wait(NEXT_CHUNK)  # the answer has begun: the rest of it is owed from now
                if response.status < 500:
                    balancer.succeeded(endpoint)
                    break
                retry = self._retry_on_error(request, endpoint, response)
                if retry is None:
                    break
                endpoint = retry
                continue
            endpoint = await self._replacement(request, endpoint, failure, error)
        if request.headers_sent and response.status != 200:
            await self._raise_engine_error(request, endpoint, response)
        # The header as sent, not `response.content_type`: that parses its parameters, which nothing here needs.
        content_type = response.headers.get("Content-Type", "")
        streamed = request.headers_sent or content_type.startswith("text/event-stream")
        if not streamed and (length := response.content_length) is not None and length <= WHOLE_BODY_LIMIT:
            await self._relay_whole(request, endpoint, response, content_type)
        else:
            await self._relay_stream(request, endpoint, response, content_type, streamed)

    def _upstream_headers(self, request: Forwarding) -> dict[str, str]:
        """The request headers every attempt of `request` sends its engine (router.forwarding.tracing adds its trace)."""
        return upstream_headers(request.scope)

    def _first_byte_overdue(self, request: Forwarding, endpoint: Endpoint) -> RouterError:
        return RouterError(
            504,
            f"Replica {endpoint.replica_id} of `{request.model}` did not answer in time: no first byte within "
            f"{self.first_byte_timeout:g} s (LLMGW_UPSTREAM_FIRST_BYTE_SECONDS).",
            "upstream_timeout",
            type_="server_error",
        )

    async def _replacement(
        self, request: Forwarding, endpoint: Endpoint, failure: Failure, error: aiohttp.ClientError
    ) -> Endpoint:
        """The replica to try after an attempt on `endpoint` failed before its response, or a RouterError.

        Nothing reached the client yet: the failure is counted (it may eject the replica) and the request
        retried once."""
        model, affinity, pools = request.model, request.affinity, request.pools
        request.exchange.wait(None)  # a hold for a replacement below is not the engine's to answer
        self.balancer.release(endpoint, failure, model)
        log.warning("replica %s of %s failed before responding: %r", endpoint.replica_id, model, error)
        nxt = self.balancer.pick(model, request.tried, affinity, pools) if len(request.tried) == 1 else None
        if nxt is None and failure is Failure.CONNECT and not request.headers_sent and not request.held:
            # Nothing accepted the connection and no other replica is left: the model's engines
            # (or their node) are gone. Hold the request as for a cold start until the control
            # plane publishes a replacement, rather than failing it; once per request.
            request.held = True
            nxt = await self.cold_start.wait_for_endpoint(model, request.tried, affinity, pools)
            if nxt is None:
                raise self.cold_start.starting_error(model)
        if nxt is None:
            raise RouterError(
                502, f"No replica of `{model}` could be reached.", "upstream_unavailable", type_="server_error"
            )
        self.metrics.retries.labels(model).inc()
        return nxt

    def _retry_on_error(self, request: Forwarding, endpoint: Endpoint, response: ClientResponse) -> Endpoint | None:
        """Record that `endpoint` answered 5xx; the replica to retry on instead (a 502/503 on the first
        attempt, while another is left), or None to relay this answer."""
        if response.status in RETRIABLE_STATUSES and len(request.tried) == 1:
            nxt = self.balancer.pick(request.model, request.tried, request.affinity, request.pools)
            if nxt is not None:
                response.close()
                self.balancer.release(endpoint, Failure.ERROR, request.model)
                self.metrics.retries.labels(request.model).inc()
                return nxt
        self.balancer.failed(endpoint, Failure.ERROR)
        return None

    async def _raise_engine_error(self, request: Forwarding, endpoint: Endpoint, response: ClientResponse) -> None:
        """The client already has a 200 and a stream: raise the engine's error, to be carried inside it."""
        status = response.status
        request.exchange.wait(NEXT_CHUNK)
        try:
            detail = (await response.content.read(64 * 1024)).decode("utf-8", "replace")
        except (aiohttp.ClientError, TimeoutError, asyncio.CancelledError) as exc:
            if not request.exchange.engine_failed(exc):
                raise
            detail = f"(its body broke off: {type(exc).__name__})"
        finally:
            response.close()
            self.balancer.release(endpoint, None, request.model)
        raise RouterError(
            status,
            f"Replica {endpoint.replica_id} of `{request.model}` answered {status}: {detail}",
            "upstream_error",
            type_="server_error",
        )

    def _finish(
        self,
        request: Forwarding,
        endpoint: Endpoint,
        response: ClientResponse,
        served: bool,
        usage: tuple[int, int] | None,
    ) -> None:
        """The answer is over (in any way): give back its connection and replica, and count it against its
        key (router.accounting.usage_reader): its last use, a request and tokens if `served`, its tokens against its limits."""
        exchange = request.exchange
        if exchange.complete:
            response.release()
        else:
            # Closing (not pooling) the connection is what makes the engine stop generating.
            response.close()
        model = request.model  # an adapter's own name, not its base's
        self.balancer.release(endpoint, None, model)
        key = exchange.key
        if key is not None:
            self.balancer.tokens.count(key, model, usage, served)
            if usage is not None:
                self.balancer.limits.spent_tokens(key, usage[0] + usage[1])

    async def _relay_whole(
        self, request: Forwarding, endpoint: Endpoint, response: ClientResponse, content_type: str
    ) -> None:
        """Read a whole answer of bounded length, then send it in one piece (so a break is still an error
        status), reading its usage on the way. Never retried once started."""
        exchange = request.exchange
        # Served: a 2xx relayed without breaking off (a client that leaves does not make it unserved).
        served = 200 <= response.status < 300
        usage = None
        try:
            try:
                body = await response.read()  # owed as the next chunk since the answer began (_send_upstream)
            except (aiohttp.ClientError, TimeoutError, asyncio.CancelledError) as exc:
                if not exchange.engine_failed(exc):
                    raise
                served = False
                # Nothing was sent yet: the client still gets an error status.
                status, message = break_message(endpoint, exc, self.idle_timeout)
                log.warning("%s (%r)", message, exc)
                raise RouterError(status, message, "upstream_failed", type_="server_error") from None
            exchange.wait(None)  # all read
            if served and exchange.key is not None:
                # A whole JSON answer: its usage is read here; nothing of it is dropped.
                encoding = response.headers.get("Content-Encoding", "")
                usage = usage_of_whole_answer(content_type, encoding, body, request.path)
            send, status = request.send, response.status
            headers = response_headers(response, endpoint)
            await send({"type": "http.response.start", "status": status, "headers": headers})
            exchange.status = status
            await send({"type": "http.response.body", "body": body, "more_body": False})
            exchange.complete = True
        finally:
            self._finish(request, endpoint, response, served, usage)

    async def _relay_stream(
        self, request: Forwarding, endpoint: Endpoint, response: ClientResponse, content_type: str, streamed: bool
    ) -> None:
        """Relay an answer chunk by chunk as the engine sends it, reading its usage and timing a stream on the way.
        Never retried once started; a break ends a stream (`streamed`: SSE) with an error event, cuts any other body."""
        send, exchange, traffic = request.send, request.exchange, self.metrics.traffic
        served = 200 <= response.status < 300
        # A gap between chunks costs a clock read, a bisect, two additions; a body not streamed counts into nothing.
        inter_token, clock, first, last = traffic.inter_token, time.perf_counter, 0.0, 0.0
        timing = inter_token.series(request.model) if streamed else inter_token.blank()
        gaps, bounds = timing[0], inter_token.bounds
        reader = answer_usage_reader(request, response, content_type) if served else None
        try:
            await begin_body(request, endpoint, response, reader)
            try:
                async for chunk in response.content.iter_any():
                    if reader is not None:
                        chunk = reader.feed(chunk)
                        if not chunk:
                            exchange.wait(NEXT_CHUNK)  # the engine sent something all the same
                            continue
                    now = clock()
                    if last:
                        gap = now - last
                        gaps[bisect_left(bounds, gap)] += 1
                        timing[1] += gap
                    else:
                        first = now
                    last = now
                    exchange.wait(None)  # while sending: a slow client's time is not the engine's silence
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    exchange.wait(NEXT_CHUNK)
                exchange.wait(None)
                if reader is not None and (rest := reader.finish()):
                    await send({"type": "http.response.body", "body": rest, "more_body": True})
            except (aiohttp.ClientError, TimeoutError, asyncio.CancelledError) as exc:
                if not exchange.engine_failed(exc):
                    raise
                served = False
                await self._end_broken(request, endpoint, exc, streamed)
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            exchange.complete = True
        finally:
            self._finish(request, endpoint, response, served, reader.usage() if reader is not None else None)
            if streamed and first:
                traffic.first_token.observe(request.model, first - request.received)

    async def _end_broken(self, request: Forwarding, endpoint: Endpoint, exc: BaseException, streamed: bool) -> None:
        """An answer broke off after it began: a stream (`streamed`) ends with an error event; any other body
        is left cut (too late for a status, and a body of known length cannot be ended early)."""
        status, message = break_message(endpoint, exc, self.idle_timeout)
        log.warning("%s (%r)", message, exc)
        if streamed:
            request.exchange.status = status
            await request.send({"type": "http.response.body", "body": sse_error_event(message, "upstream_failed")})


def answer_usage_reader(
    request: Forwarding, response: ClientResponse, content_type: str
) -> JsonUsage | SseUsage | None:
    """What reads the usage of a served answer whose key records tokens; None when nothing is recorded."""
    if request.exchange.key is None:
        return None
    return usage_reader(content_type, response.headers.get("Content-Encoding", ""), request.pass_usage, request.path)


async def begin_body(
    request: Forwarding, endpoint: Endpoint, response: ClientResponse, reader: JsonUsage | SseUsage | None
) -> None:
    """Send an answer's status and headers, unless a hold sent them already; from now the engine's silence is timed."""
    if not request.headers_sent:
        # A body that may lose its usage event cannot keep the engine's length.
        headers = response_headers(response, endpoint, without_length=reader is not None and reader.drops)
        await request.send({"type": "http.response.start", "status": response.status, "headers": headers})
    request.exchange.status = response.status
    request.exchange.wait(NEXT_CHUNK)
