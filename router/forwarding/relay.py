"""Relaying an engine's answer to the client, once its response has begun, and counting what it served.

A whole answer of known, bounded length is read before anything is sent, so
its failure is still a 502/504 in OpenAI's shape. Anything else is relayed
chunk by chunk as the engine sends it: read a chunk, account for it (its
usage, its timing), send it. A stream (SSE) that breaks ends with an OpenAI
error event, which the OpenAI SDKs raise as an APIError; only a large or
unbounded non-SSE body can still be cut. Nothing here is retried: bytes may
have reached the client.

Each answer's token usage is read as it is relayed (router.accounting.usage_reader)
and counted per key and model in the ledger when the answer ends, in any way;
a LoRA adapter's under the adapter's own name. A stream's chunk is accounted
for inline: its usage (the reader may hold part of it back until an event is
whole), then the gap since the last chunk, counted straight into the model's
inter-token series (router.metrics.Histogram). A Python call costs about as
much as the rest of a chunk's accounting (measured: docs/benchmarks.md), and
an answer has a chunk per token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_left

import aiohttp
from aiohttp import ClientResponse

from router.accounting.budgets import BudgetGate
from router.accounting.ledger import Ledger
from router.accounting.usage_reader import JsonUsage, SseUsage, usage_of_whole_answer, usage_reader
from router.endpoints.table import Endpoint
from router.errors import EngineEndedUnfinished, RouterError
from router.forwarding.continuation import check_finished_well
from router.forwarding.exchange import Forwarding
from router.forwarding.headers import UPSTREAM_FAILED, break_message, response_headers, sse_error_event
from router.forwarding.moves import StreamMoves
from router.metrics import RouterMetrics
from router.picking.picker import Picker

log = logging.getLogger(__name__)


class Relay:
    """Relays begun answers (whole or chunk by chunk) and, when each ends, gives its replica back and counts it."""

    def __init__(
        self,
        picker: Picker,
        ledger: Ledger,
        metrics: RouterMetrics,
        idle_timeout: float,
        moves: StreamMoves,
        budgets: BudgetGate | None = None,
    ) -> None:
        self.picker = picker
        self.budgets = budgets  # settles a budgeted answer before its last byte (router.accounting.budgets)
        self.ledger = ledger
        self.metrics = metrics
        self.idle_timeout = idle_timeout
        self.moves = moves  # where a continuable stream's leg is known by its replica, for a move to find it

    async def whole(
        self, request: Forwarding, endpoint: Endpoint, response: ClientResponse, content_type: str, resendable: bool
    ) -> None:
        """Read a whole answer of bounded length, then send it in one piece (so a break is still an error
        status), reading its usage on the way. A `resendable` answer its engine ended unfinished (a forced sleep's
        abort) is a break too: nothing of it was sent, so the proxy may ask another replica."""
        exchange = request.exchange
        # Served: a 2xx relayed without breaking off (a client that leaves does not make it unserved).
        served = 200 <= response.status < 300
        usage = None
        try:
            try:
                body = await response.read()  # the next chunk's deadline runs since the answer began
            except (aiohttp.ClientError, TimeoutError, asyncio.CancelledError) as exc:
                if not exchange.engine_failed(exc):
                    raise
                served = False
                # Nothing was sent yet: the client still gets an error status.
                status, message = break_message(endpoint, exc, self.idle_timeout)
                log.warning("%s (%r)", message, exc)
                raise RouterError(status, message, UPSTREAM_FAILED, type_="server_error") from None
            exchange.stop_deadline()  # all read
            if resendable and served and (b'"abort"' in body or b'"error"' in body):
                unfinished = self._unfinished(endpoint, body)
                if unfinished is not None:
                    served = False  # not counted here: the replica that answers it again counts it
                    raise unfinished
            if served and exchange.key is not None:
                # A whole JSON answer: its usage is read here; nothing of it is dropped.
                encoding = response.headers.get("Content-Encoding", "")
                usage = usage_of_whole_answer(content_type, encoding, body, request.path)
            send, status = request.send, response.status
            headers = response_headers(response, endpoint, request.queue_wait)
            await send({"type": "http.response.start", "status": status, "headers": headers})
            exchange.status = status
            if exchange.hold is not None and served:
                await self._settle(request, usage)
            await send({"type": "http.response.body", "body": body, "more_body": False})
            exchange.complete = True
        finally:
            self._finish(request, endpoint, response, served, usage)

    def _unfinished(self, endpoint: Endpoint, body: bytes) -> RouterError | None:
        """The RouterError (502, caused by the end) of a whole answer its engine ended unfinished; None if it
        finished well."""
        try:
            check_finished_well(body)
        except EngineEndedUnfinished as exc:
            status, message = break_message(endpoint, exc, self.idle_timeout)
            log.warning(message)
            error = RouterError(status, message, UPSTREAM_FAILED, type_="server_error")
            error.__cause__ = exc
            return error
        return None

    async def stream(
        self, request: Forwarding, endpoint: Endpoint, response: ClientResponse, content_type: str, streamed: bool
    ) -> None:
        """Relay an answer chunk by chunk (a break: see the module docstring); `streamed`: it is SSE."""
        send, exchange, traffic, transcript = request.send, request.exchange, self.metrics.traffic, request.transcript
        served = 200 <= response.status < 300
        reader = self._reader(request, response, content_type) if served else None
        counted = True  # the answer is counted when this leg ends: not when another replica continues it
        inter_token, clock, first, last = traffic.inter_token, time.perf_counter, 0.0, 0.0
        timing = inter_token.series(request.model) if streamed else inter_token.blank()
        gaps, bounds = timing[0], inter_token.bounds
        try:
            await self._begin_body(request, endpoint, response, reader)
            try:
                async for chunk in response.content.iter_any():
                    # Account for it: its usage, then its gap since the last chunk sent.
                    if reader is not None and not (chunk := reader.feed(chunk)):
                        exchange.start_next_chunk_deadline()  # held back: the engine sent something all the same
                        continue
                    now = clock()
                    if last:
                        gap = now - last
                        gaps[bisect_left(bounds, gap)] += 1
                        timing[1] += gap
                    else:
                        first = now
                    last = now
                    # Send it: the time a slow client takes is not the engine's silence.
                    exchange.stop_deadline()
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    exchange.start_next_chunk_deadline()
                exchange.stop_deadline()
                if reader is not None and (rest := reader.finish()):  # the stream ended: nothing left to keep
                    await send({"type": "http.response.body", "body": rest, "more_body": True})
                if exchange.hold is not None and served:  # a test, and no call, for a request without budgets
                    await self._settle(request, reader.usage() if reader is not None else None)
            except (aiohttp.ClientError, TimeoutError, asyncio.CancelledError, EngineEndedUnfinished) as exc:
                if (failure := exchange.failure(exc)) is None:
                    raise
                served = False
                counted = await self._broke(request, endpoint, failure, streamed, reader is not None, last)
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            exchange.complete = True
        finally:
            if transcript is not None:
                self.moves.streams.pop(request, None)
            self._finish(request, endpoint, response, served, reader.usage() if reader is not None else None, counted)
            if streamed and first and (transcript is None or not transcript.migrations):
                traffic.first_token.observe(request.model, first - request.received)

    @classmethod
    def _reader(cls, request: Forwarding, response: ClientResponse, content_type: str) -> JsonUsage | SseUsage | None:
        """What reads a served answer as it is relayed: a stream that may be continued on another replica is read
        and kept (router.forwarding.continuation); another answer is read where its key records tokens."""
        transcript = request.transcript
        if transcript is not None:
            return transcript.reader(request.pass_usage)
        return cls._usage_reader(request, response, content_type)

    @staticmethod
    def _usage_reader(request: Forwarding, response: ClientResponse, content_type: str) -> JsonUsage | SseUsage | None:
        """What reads the usage of a served answer whose key records tokens; None when nothing is recorded."""
        if request.exchange.key is None:
            return None
        encoding = response.headers.get("Content-Encoding", "")
        return usage_reader(content_type, encoding, request.pass_usage, request.path)

    async def _begin_body(
        self, request: Forwarding, endpoint: Endpoint, response: ClientResponse, reader: JsonUsage | SseUsage | None
    ) -> None:
        """Send an answer's status and headers, unless a hold or an earlier leg of the stream sent them already;
        from now the engine's silence is timed, and a continuable stream may be moved off its replica."""
        if reader is not None and request.transcript is not None:
            moves = self.moves
            moves.streams[request] = endpoint.replica_id
            if moves.due:
                moves.begun_on_due(endpoint.replica_id, request)
        if not request.headers_sent:
            # A body that may lose its usage event cannot keep the engine's length.
            drops = reader is not None and reader.drops
            headers = response_headers(response, endpoint, request.queue_wait, without_length=drops)
            await request.send({"type": "http.response.start", "status": response.status, "headers": headers})
            request.headers_sent = True
        request.exchange.status = response.status
        request.exchange.start_next_chunk_deadline()

    async def _broke(
        self, request: Forwarding, endpoint: Endpoint, exc: BaseException, streamed: bool, read: bool, last: float
    ) -> bool:
        """An answer broke off after it began (its `last` chunk sent then, 0: none): whether it is counted now. A
        continuable stream whose events were `read` is the proxy's to continue (router.forwarding.resume), and its
        last leg counts it; any other ends."""
        transcript = request.transcript
        if transcript is not None and read:
            transcript.broken = (endpoint, exc)
            transcript.last_sent = last or transcript.last_sent  # the client's pause runs from there
            return False
        await self.end_broken(request, endpoint, exc, streamed)
        return True

    async def end_broken(self, request: Forwarding, endpoint: Endpoint, exc: BaseException, streamed: bool) -> None:
        """An answer broke off after it began: a stream (`streamed`) ends with an error event; any other body
        is left cut (too late for a status, and a body of known length cannot be ended early)."""
        status, message = break_message(endpoint, exc, self.idle_timeout)
        log.warning("%s (%r)", message, exc)
        if streamed:
            request.exchange.status = status
            await request.send({"type": "http.response.body", "body": sse_error_event(message, UPSTREAM_FAILED)})

    async def _settle(self, request: Forwarding, usage: tuple[int, int] | None) -> None:
        """Settle the answer's budgets before its last byte: a client that sends its next request once this one
        has ended finds its budgets charged with this one's cost, not its worst case. (Cancelled midway, it is
        settled again beside the request: a reservation is settled once, whichever comes first.)"""
        assert self.budgets is not None and request.exchange.hold is not None  # a hold is made only with a gate
        await self.budgets.settle_now(request.exchange.hold, usage)
        request.exchange.settled = True

    def count_unserved(self, request: Forwarding, served: bool = False) -> None:
        """Count a stream whose legs counted nothing (router.forwarding.resume ended it): a request, tokens unknown."""
        if request.transcript is not None:
            request.transcript.counted = True
        if request.exchange.key is not None:
            self.ledger.tokens.count(request.exchange.key, request.model, None, served)

    def _finish(
        self,
        request: Forwarding,
        endpoint: Endpoint,
        response: ClientResponse,
        served: bool,
        usage: tuple[int, int] | None,
        counted: bool = True,
    ) -> None:
        """The answer is over (in any way): give back its connection and replica, and count it against its
        key: a request and tokens if `served`, its tokens against its rate limits (unless not `counted`: it goes
        on on another replica, whose leg counts the whole request)."""
        exchange = request.exchange
        if exchange.complete:
            response.release()
        else:
            # Closing (not pooling) the connection is what makes the engine stop generating.
            response.close()
        model = request.model  # an adapter's own name, not its base's
        self.picker.release(endpoint, None, model)
        key = exchange.key
        if counted and request.transcript is not None:
            request.transcript.counted = True
        if key is not None and counted:
            exchange.usage = usage
            # A request holding a budget's reservation is charged by its settlement (router.accounting.budgets);
            # a fleet without prices looks nothing up.
            prices = self.picker.routes.prices
            priced = prices.get(model) if prices and exchange.hold is None else None
            self.ledger.tokens.count(key, model, usage, served, priced, endpoint.replica_id)
            if usage is not None:
                self.ledger.limits.spent_tokens(key, usage[0] + usage[1])
