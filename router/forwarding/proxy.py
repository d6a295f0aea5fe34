"""Forwarding one request to an engine replica, up to the moment its answer begins.

One aiohttp ClientSession (opened at router start-up) carries every upstream
request. Per-phase deadlines only, never an overall one, so a stream runs as
long as the engine keeps sending: connecting (a refused or slow connect is
retried on another replica), the first byte of the answer (then 504: the
engine may be working on it, so it is not sent again), and silence between
chunks once the answer has begun (router.forwarding.exchange). A request is
retried once on another replica, but only before any byte reached the client;
a client that goes away closes the upstream connection, which is what makes
the engine stop generating. How each attempt ended before its response began
goes to the picker, which ejects replicas that keep failing. Once the answer
begins, the relay (router.forwarding.relay) takes it to the client.

Traces (router.forwarding.tracing) wrap three steps through ForwardingHooks:
the whole request, its hold for a replica and its upstream exchange. Without
them the proxy checks one attribute per step and runs none of their code.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import aiohttp
from aiohttp import ClientResponse

from router.accounting.budgets import BudgetGate
from router.accounting.ledger import Ledger
from router.accounting.usage_reader import IN_OUT_USAGE_PATHS, ask_for_usage
from router.config import RouterConfig
from router.endpoints.table import STREAMS_BY_IDS, STREAMS_BY_TEXT, Endpoint
from router.errors import RouterError
from router.forwarding.admission import Admission
from router.forwarding.coldstart import ColdStart
from router.forwarding.continuation import CHAT_PATHS, CONTINUABLE_PATHS, NO_REPLICA, RESENT, ask_for_token_ids
from router.forwarding.exchange import Forwarding
from router.forwarding.headers import (
    RETRIABLE_STATUSES,
    SSE_HEADERS,
    UPSTREAM_FAILED,
    WHOLE_BODY_LIMIT,
    break_reason,
    upstream_headers,
)
from router.forwarding.moves import StreamMoves
from router.forwarding.relay import Relay
from router.forwarding.resume import Resumer
from router.forwarding.transcript import Transcript
from router.metrics import RouterMetrics
from router.picking.ejection import Failure
from router.picking.picker import Picker

log = logging.getLogger(__name__)


class ForwardingHooks(Protocol):
    """Steps of a request the proxy lets a hook wrap (router.forwarding.tracing): each is handed the step to run."""

    async def forward(self, request: Forwarding, step: Callable[[Forwarding], Awaitable[None]]) -> None:
        """Run `step(request)`: the whole request, from its pick to its answer's end."""

    async def hold(self, request: Forwarding, step: Callable[[Forwarding], Awaitable[Endpoint]]) -> Endpoint:
        """Run `step(request)`: the wait for a replica of a model that has none ready; return what it returns."""

    async def send(
        self, request: Forwarding, endpoint: Endpoint, step: Callable[[Forwarding, Endpoint], Awaitable[None]]
    ) -> None:
        """Run `step(request, endpoint)`: the upstream exchange, retries included, until the answer's end."""

    def upstream_headers(self, headers: dict[str, str]) -> None:
        """Add to the headers every attempt sends the engine (called within `send`)."""


class Proxy:
    """Sends requests to a replica of their model (waiting for a cold start if need be) until the answer begins."""

    def __init__(
        self,
        picker: Picker,
        ledger: Ledger,
        metrics: RouterMetrics,
        cold_start: ColdStart,
        config: RouterConfig,
        hooks: ForwardingHooks | None = None,
        budgets: BudgetGate | None = None,
    ):
        self.picker = picker
        self.metrics = metrics
        self.cold_start = cold_start
        self.hooks = hooks
        self.first_byte_timeout = config.first_byte_timeout
        self.migrations = config.stream_migrations
        # Streams moved off replicas leaving service when the table asks (RouterState.apply_table plans them).
        self.moves = StreamMoves()
        self.relay = Relay(picker, ledger, metrics, config.idle_timeout, self.moves, budgets)
        self.routes = picker.routes
        # Full models' fair queues (router.forwarding.admission): a request waits there rather than in an engine.
        self.admission = Admission(
            picker,
            max_waiting=config.queue_max_waiting,
            max_wait_seconds=config.queue_max_wait_seconds,
            keepalive_seconds=config.keepalive_seconds,
        )
        send_leg = self._send_upstream if hooks is None else self._hooked_send
        self.resumer = Resumer(picker, self.routes, cold_start, self.relay, metrics, self.migrations, send_leg)
        # Per-phase deadlines only: a stream may run as long as the engine keeps sending. aiohttp keeps
        # the connect deadline; the first byte's and the next chunk's are the sweep's (router.forwarding.inflight).
        self.timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout, sock_read=None)
        self.session: aiohttp.ClientSession | None = None
        # Chosen once here, not per request: a router without hooks runs no line of theirs, nor a call more.
        self.forward: Callable[[Forwarding], Awaitable[None]] = self._forward if hooks is None else self._hooked

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
        """Close the upstream session (and drop the planned moves)."""
        self.moves.close()
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def _hooked(self, request: Forwarding) -> None:
        assert self.hooks is not None  # chosen as `forward` only with hooks
        await self.hooks.forward(request, self._forward)

    async def _hooked_send(self, request: Forwarding, endpoint: Endpoint) -> None:
        assert self.hooks is not None  # chosen as a continuation's `send_leg` only with hooks
        await self.hooks.send(request, endpoint, self._send_upstream)

    async def _forward(self, request: Forwarding) -> None:
        """`forward`: answer `request` from a replica of its model; a RouterError if none can (before the response
        began)."""
        if self.session is None:
            raise RouterError(503, "The router is not started.", "router_not_started", type_="server_error")
        if request.streaming and request.path not in IN_OUT_USAGE_PATHS:
            # An OpenAI stream's tokens come only in a usage chunk the engine sends when asked; Anthropic's and
            # the Responses API's streams always carry theirs (router.accounting.usage_reader).
            request.body, request.pass_usage = ask_for_usage(request.body)
            continuable = self.migrations and request.path in CONTINUABLE_PATHS
            if continuable and (way := self.routes.streams.get(request.model, STREAMS_BY_TEXT)):  # not STREAMS_OFF
                self._keep_transcript(request, way == STREAMS_BY_IDS)
        hooks = self.hooks
        try:
            endpoint = self.picker.pick(request.model, (), request.affinity, request.pools)
            if endpoint is None:
                if hooks is None:
                    endpoint = await self._wait_for_replica(request)
                else:
                    endpoint = await hooks.hold(request, self._wait_for_replica)
            if endpoint.capacity and self.admission.must_wait(endpoint, request):
                endpoint = await self.admission.wait(request, endpoint)
            if hooks is None:
                await self._send_upstream(request, endpoint)
            else:
                await hooks.send(request, endpoint, self._send_upstream)
            if request.transcript is not None and request.transcript.broken is not None:
                await self.resumer.resume(request)
        except RouterError as exc:
            if not request.headers_sent:
                raise
            # The stream has begun: its error travels inside it, as an OpenAI error event.
            request.exchange.status = exc.status
            event = b"data: " + exc.body() + b"\n\n"
            await request.send({"type": "http.response.body", "body": event, "more_body": False})

    def _keep_transcript(self, request: Forwarding, by_ids: bool) -> None:
        """Keep what `request`'s stream relays, so another replica can continue it; ask its engines for token ids
        where they give them (`by_ids`: router.forwarding.continuation), unless the client asked for them or not
        itself."""
        client_ids = b"return_token_ids" in request.body
        asked_ids = by_ids and not client_ids
        if asked_ids:
            request.body = ask_for_token_ids(request.body)
        request.transcript = Transcript(request.path in CHAT_PATHS, client_ids, asked_ids)

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
        """Send the request to `endpoint` (again to another replica if it fails before answering); relay the answer."""
        session, picker, exchange = self.session, self.picker, request.exchange
        assert session is not None  # forward() refuses to start without one
        headers = upstream_headers(request.scope)
        if self.hooks is not None:
            self.hooks.upstream_headers(headers)
        failure: Failure
        error: aiohttp.ClientError
        while True:
            request.tried.append(endpoint)
            exchange.start_first_byte_deadline()  # a retry has a deadline of its own
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
                    picker.release(endpoint, None, request.model)
                    raise
                # Not retried: the engine accepted the request and may be working on it.
                picker.release(endpoint, Failure.LOST, request.model)
                raise self._first_byte_overdue(request, endpoint) from None
            except BaseException:
                picker.release(endpoint, None, request.model)
                raise
            else:
                self.metrics.traffic.upstream_latency(request.model, time.perf_counter() - started)
                exchange.start_next_chunk_deadline()  # the answer has begun: the rest of it is owed from now
                if response.status < 500:
                    picker.succeeded(endpoint)
                    break
                retry = self._retry_on_error(request, endpoint, response)
                if retry is None:
                    break
                endpoint = retry
                continue
            endpoint = await self._replacement(request, endpoint, failure, error)
        if request.headers_sent and response.status != 200:
            await self._raise_engine_error(request, endpoint, response)
        await self._relay(request, endpoint, response)

    async def _relay(self, request: Forwarding, endpoint: Endpoint, response: ClientResponse) -> None:
        """Relay the answer that began (router.forwarding.relay): a whole one of bounded length read first (and asked
        of another replica if it broke before any of it was sent), anything else as it comes."""
        content_type = response.headers.get("Content-Type", "")  # as sent: `response.content_type` parses it
        streamed = request.headers_sent or content_type.startswith("text/event-stream")
        if not streamed and (length := response.content_length) is not None and length <= WHOLE_BODY_LIMIT:
            try:
                # Only where it may be asked again: otherwise the client gets the engine's answer as it came.
                resendable = (
                    request.resent < self.migrations
                    and request.path in CONTINUABLE_PATHS
                    and self.routes.continues(request.model)
                )
                await self.relay.whole(request, endpoint, response, content_type, resendable)
            except RouterError as exc:
                if exc.code != UPSTREAM_FAILED or (nxt := self._resend_whole(request, exc)) is None:
                    raise
                await self._send_upstream(request, nxt)
        else:
            await self.relay.stream(request, endpoint, response, content_type, streamed)

    def _resend_whole(self, request: Forwarding, broke: RouterError) -> Endpoint | None:
        """The replica to send again a request whose whole answer broke off (`broke`: 502 lost or ended unfinished,
        504 silent) before any of it reached the client (nothing was sent, so another replica answers it afresh),
        or None: not within
        the request's limit (LLMGW_STREAM_MIGRATIONS), its model's switch, or the replicas ready now."""
        model = request.model
        if request.resent >= self.migrations or not self.routes.continues(model):
            return None
        nxt = self.picker.pick(model, request.tried, request.affinity, request.pools)
        outcome = RESENT if nxt is not None else NO_REPLICA
        self.metrics.continuations.labels(model, break_reason(broke), outcome).inc()
        self.picker.ledger.continuations.count(model, outcome)
        request.resent += 1
        return nxt

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
        request.exchange.stop_deadline()  # a hold for a replacement below is not the engine's to answer
        self.picker.release(endpoint, failure, model)
        log.warning("replica %s of %s failed before responding: %r", endpoint.replica_id, model, error)
        nxt = self.picker.pick(model, request.tried, affinity, pools) if len(request.tried) == 1 else None
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
            nxt = self.picker.pick(request.model, request.tried, request.affinity, request.pools)
            if nxt is not None:
                response.close()
                self.picker.release(endpoint, Failure.ERROR, request.model)
                self.metrics.retries.labels(request.model).inc()
                return nxt
        self.picker.failed(endpoint, Failure.ERROR)
        return None

    async def _raise_engine_error(self, request: Forwarding, endpoint: Endpoint, response: ClientResponse) -> None:
        """The client already has a 200 and a stream: raise the engine's error, to be carried inside it."""
        status = response.status
        request.exchange.start_next_chunk_deadline()
        try:
            detail = (await response.content.read(64 * 1024)).decode("utf-8", "replace")
        except (aiohttp.ClientError, TimeoutError, asyncio.CancelledError) as exc:
            if not request.exchange.engine_failed(exc):
                raise
            detail = f"(its body broke off: {type(exc).__name__})"
        finally:
            response.close()
            self.picker.release(endpoint, None, request.model)
        raise RouterError(
            status,
            f"Replica {endpoint.replica_id} of `{request.model}` answered {status}: {detail}",
            "upstream_error",
            type_="server_error",
        )
