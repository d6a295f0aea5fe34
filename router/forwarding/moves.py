"""Moving streams off replicas that leave service, when the control plane asks (DESIGN "Stopping is always a drain").

A drained or sleeping replica is unpublished first, and its engine finishes
what it holds for up to LLMGW_DRAIN_TIMEOUT_SECONDS. The endpoint table names
such replicas in `moving`, with the time by which the control plane wants
them idle (reconciler.endpoints). At that time each router moves every
continuable stream it still relays from one of them: the stream is cut between
two chunks (Exchange.move) and continued on another replica like a stream
whose engine broke off (router.forwarding.resume), with the reason
`replica_leaving`. The engine, left with nothing, is stopped or put to sleep as
drained, and the answers go on. A stream that could not be continued (a
refusal, or its limit of LLMGW_STREAM_MIGRATIONS reached) is not cut: it runs
on until its engine stops, as without moves.

Bookkeeping costs a continuable stream a dict entry for each leg; a stream
that is not continuable costs nothing; the table costs a timer per replica
leaving service.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from router.forwarding.continuation import read_answer, refusal
from router.forwarding.exchange import Forwarding

log = logging.getLogger(__name__)


def may_move(request: Forwarding, limit: int) -> bool:
    """Whether the stream would be continued if it were cut now (as router.forwarding.resume decides): it has
    legs left of its `limit`, and nothing of the request or of the answer so far refuses a continuation."""
    transcript = request.transcript
    if transcript is None or transcript.migrations >= limit:
        return False
    if transcript.path:
        path, payload = transcript.path, transcript.payload
    else:  # the first leg: the request as the client sent it, read as the first break would read it
        path, payload = request.path, json.loads(request.body)
    answer = transcript.answer if transcript.answer is not None else read_answer(b"".join(transcript.kept))
    return refusal(path, payload, answer) is None


class StreamMoves:
    """The continuable streams being relayed, by the replica relaying them, and the moves the endpoint table asks
    for (at most `limit` legs a stream: LLMGW_STREAM_MIGRATIONS).

    The relay writes `streams` itself, one dict entry a leg (no call: it is on every stream's way); a move reads
    them all, which happens once per replica leaving service.
    """

    def __init__(self, limit: int, clock: Callable[[], float] = time.time) -> None:
        self.limit = limit
        self.clock = clock
        self.streams: dict[Forwarding, str] = {}  # continuable stream -> the replica relaying its leg now
        self.due: set[str] = set()  # replicas whose time has come: a stream that begins on one moves at once
        self._planned: dict[str, tuple[float, asyncio.TimerHandle]] = {}  # replica id -> (when, its timer)

    def begun_on_due(self, replica_id: str, request: Forwarding) -> None:
        """A stream's leg began on a replica whose time has come (the relay asks only when some has): move it."""
        if replica_id in self.due:
            self._move(replica_id, [request])

    def plan(self, moving: dict[str, float]) -> None:
        """Follow the installed table's moves: a timer per replica at its time (now, if it has passed), none left
        for replicas the table no longer names (back in service, or gone)."""
        for replica_id in self._planned.keys() - moving.keys():
            self._planned.pop(replica_id)[1].cancel()
        self.due &= moving.keys()
        if not moving:
            return
        loop, now = asyncio.get_running_loop(), self.clock()
        for replica_id, when in moving.items():
            planned = self._planned.get(replica_id)
            if replica_id in self.due or (planned is not None and planned[0] == when):
                continue
            if planned is not None:
                planned[1].cancel()
            timer = loop.call_later(max(0.0, when - now), self.move, replica_id)
            self._planned[replica_id] = (when, timer)

    def move(self, replica_id: str) -> int:
        """Move the continuable streams relayed from `replica_id`, now and as they begin; returns how many."""
        self._planned.pop(replica_id, None)
        self.due.add(replica_id)
        return self._move(replica_id, [request for request, on in self.streams.items() if on == replica_id])

    def _move(self, replica_id: str, streams: list[Forwarding]) -> int:
        moved = [request for request in streams if may_move(request, self.limit)]
        for request in moved:
            request.exchange.move()
        if streams:
            log.info(
                "replica %s is leaving service: moving %d of its %d streams to other replicas",
                replica_id,
                len(moved),
                len(streams),
            )
        return len(moved)

    def close(self) -> None:
        """Cancel the timers (the router is stopping)."""
        for _, timer in self._planned.values():
            timer.cancel()
        self._planned.clear()
