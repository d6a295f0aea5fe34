"""What the proxy does when a continuable stream's engine broke off: continue it on another replica, or end it.

router.forwarding.continuation says what may be continued and how; this is
the loop around it. Each break is counted
(`llmgw_router_stream_continuations_total{model,reason,outcome}`). A stream
may be continued when the request allows it (`refusal`), it has not broken
LLMGW_STREAM_MIGRATIONS times in a row without a token coming back, and a
replica other than those that broke is ready, or becomes ready while the request waits as for a cold start
(keep-alives included). The next leg is sent and relayed like the first, by
the proxy's own upstream exchange, and its failure before answering counts as
another break. A stream that cannot go on ends as it always did: with an
error event naming the break.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

from router.endpoints.routes import RouteTable
from router.endpoints.table import Endpoint
from router.errors import ReplicaLeaving, RouterError
from router.forwarding.coldstart import ColdStart
from router.forwarding.continuation import (
    CHAT_PATHS,
    CONTINUED,
    LIMIT,
    NO_REPLICA,
    continuation,
    refusal,
    remaining_tokens,
)
from router.forwarding.exchange import Forwarding
from router.forwarding.headers import SSE_DONE, break_reason
from router.forwarding.relay import Relay
from router.forwarding.transcript import Transcript
from router.metrics import RouterMetrics
from router.picking.picker import Picker

log = logging.getLogger(__name__)

# The outcome of a stream whose finish reason the client already had: only the end of the stream was missing.
FINISHED = "finished"


class Resumer:
    """Continues broken streams on other replicas, or ends them with an error event (after `limit` continuations in
    a row that brought no token).

    `send_leg(request, endpoint)` is the proxy's upstream exchange (its hooks
    included, so each leg is a span of its own when traces are on).
    """

    def __init__(
        self,
        picker: Picker,
        routes: RouteTable,
        cold_start: ColdStart,
        relay: Relay,
        metrics: RouterMetrics,
        limit: int,
        send_leg: Callable[[Forwarding, Endpoint], Awaitable[None]],
    ) -> None:
        self.picker, self.routes, self.cold_start, self.relay = picker, routes, cold_start, relay
        self.metrics, self.limit, self.send_leg = metrics, limit, send_leg

    async def resume(self, request: Forwarding) -> None:
        """Continue `request`'s stream until it ends whole, or end it with the error of its last break."""
        transcript = request.transcript
        assert transcript is not None
        if not transcript.path:
            transcript.path, transcript.payload = request.path, json.loads(request.body)
        try:
            while (broken := transcript.broken) is not None:
                transcript.broken = None
                endpoint, exc = broken
                transcript.gap = None
                transcript.last_sent = transcript.last_sent or time.perf_counter()
                outcome, nxt = await self._next_leg(request, transcript, endpoint, exc)
                self.metrics.continuations.labels(request.model, break_reason(exc), outcome).inc()
                self.picker.ledger.continuations.count(request.model, outcome)
                if nxt is None:
                    return
                await self._run_leg(request, transcript, nxt)
        except BaseException as exc:
            if not transcript.counted:
                # It ended between legs: the client went away while another replica was found (served, as the
                # relay counts a client that leaves), or the next replica refused the continuation.
                self.relay.count_unserved(request, served=isinstance(exc, asyncio.CancelledError))
            raise

    async def _next_leg(
        self, request: Forwarding, transcript: Transcript, endpoint: Endpoint, exc: BaseException
    ) -> tuple[str, Endpoint | None]:
        """(CONTINUED, the replica to send the next leg to), `request` made ready for it; or end the stream and
        return (why not, None)."""
        log.warning("replica %s of %s broke off a stream (%r)", endpoint.replica_id, request.model, exc)
        request.exchange.stop_deadline()  # a wait for another replica is no engine's silence
        request.exchange.moving = False  # a move asked of the leg that broke is not the next leg's
        answer = transcript.read()
        path, payload = transcript.path, transcript.payload
        left = remaining_tokens(path, payload, answer.produced)
        if answer.finish is not None or (left is not None and left <= 0):
            await self._end_finished(request)
            return FINISHED, None
        why = refusal(path, payload, answer)
        # LLMGW_STREAM_MIGRATIONS bounds what failing engines cost: a request that breaks every engine it reaches
        # does so before its next token, so only continuations that brought none count. A stream that moves on
        # with each leg is what a fleet losing engines looks like: it is carried to its end, each leg shorter. A
        # move off a replica leaving service (a drain, a sleep) is the control plane's doing and counts never.
        leaving = isinstance(exc, ReplicaLeaving)
        if answer.produced > transcript.mark:
            transcript.mark, transcript.fruitless = answer.produced, 0
        if why is None and transcript.fruitless >= self.limit and not leaving:
            why = LIMIT
        nxt = None if why is not None else await self._replica(request, (*transcript.refused, endpoint))
        if nxt is None:
            await self.relay.end_broken(request, endpoint, exc, streamed=True)
            self.relay.count_unserved(request)
            return why or NO_REPLICA, None
        exact = answer.exact() and self.routes.gives_token_ids(request.model)
        if exact and path in CHAT_PATHS and payload.get("tools") and payload.get("tool_choice") != "none":
            exact = False  # a text completion would not parse a tool call the rest may begin
        request.path, body = continuation(path, payload, answer, exact)
        request.body = json.dumps(body).encode()
        transcript.migrations += 1
        transcript.charged = not leaving
        transcript.fruitless += transcript.charged
        return CONTINUED, nxt

    async def _replica(self, request: Forwarding, tried: tuple[Endpoint, ...]) -> Endpoint | None:
        """A ready replica of the model but those `tried` (the one that broke, and any that refused since the
        stream last moved on), waiting for one as for a cold start; None if none. One that broke earlier may serve
        again: at the same address, it is an engine started again there."""
        model = request.model
        endpoint = self.picker.pick(model, tried, request.affinity, request.pools)
        if endpoint is not None:
            return endpoint
        try:
            if self.cold_start.keepalive_seconds > 0:
                return await self.cold_start.wait_with_keepalives(
                    request.send, model, request.affinity, request.pools, exclude=tried
                )
            return await self.cold_start.wait_for_endpoint(model, tried, request.affinity, request.pools)
        except RouterError as exc:
            log.warning("no replica of %s to continue a stream on: %s", model, exc.message)
            return None

    async def _run_leg(self, request: Forwarding, transcript: Transcript, endpoint: Endpoint) -> None:
        """Send and relay the leg `_next_leg` prepared to `endpoint`; a failure before it answered is another
        break, not counted against the request's limit (nothing of it was relayed: a replica dead but not yet
        unpublished, say). Such a replica is not asked again until the stream moves on, so those tries end when
        the replicas do."""
        try:
            await self.send_leg(request, endpoint)
        except RouterError as exc:
            if exc.status < 500:
                raise  # the replica refused the continuation itself: another would too
            transcript.broken = (endpoint, exc)
            transcript.migrations -= 1
            transcript.fruitless -= transcript.charged
            transcript.refused += (endpoint,)
        else:
            transcript.refused = ()
        if transcript.gap is not None:
            self.metrics.continuation_gap.labels(request.model).observe(transcript.gap)
            transcript.gap = None
        self.metrics.reprocessed_prompt_tokens.labels(request.model).inc(transcript.reprocessed)
        self.picker.ledger.continuations.reprocessed(request.model, transcript.reprocessed)
        transcript.reprocessed = 0

    async def _end_finished(self, request: Forwarding) -> None:
        """The client had the answer's finish reason: only the end of the stream was lost. End it."""
        await request.send({"type": "http.response.body", "body": SSE_DONE, "more_body": False})
        request.exchange.complete = True
        self.relay.count_unserved(request, served=True)
