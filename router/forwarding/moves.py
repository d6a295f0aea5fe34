"""Moving streams off replicas that leave service, when the control plane asks (DESIGN "Stopping is always a drain").

A drained or sleeping replica is unpublished first, and its engine finishes
what it holds for up to LLMGW_DRAIN_TIMEOUT_SECONDS. The endpoint table names
such replicas in `moving`, with the time by which the control plane wants
them idle (reconciler.endpoints). At that time each router moves every
continuable stream it still relays from one of them: the stream is cut between
two chunks (Exchange.move) and continued on another replica like a stream
whose engine broke off (router.forwarding.resume), with the reason
`replica_leaving`. They move MOVE_BATCH at a time, a batch every
MOVE_PAUSE_SECONDS, so their continuations do not queue behind each other
while the rest still stream from the leaving engine. The engine, left with
nothing, is stopped or put to sleep as drained, and the answers go on. A stream that could not be continued (a
refusal: guided decoding, a tool call begun…) is not cut: it runs on until its
engine stops, as without moves. A move uses none of the stream's
LLMGW_STREAM_MIGRATIONS, which bound what failing engines cost.

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

from router.forwarding.continuation import Answer, read_answer, refusal
from router.forwarding.exchange import Forwarding

log = logging.getLogger(__name__)

# The words of a delta that refuses a continuation once sent (continuation.refusal: a tool call, reasoning).
_ANSWER_REFUSALS = (b'"tool_calls"', b'"function_call"', b'"reasoning')
_NOTHING_YET = Answer()  # an answer with none of them, for refusal() to judge the request alone (never changed)
# Streams moved at once, then the next as many after a pause: a replica's streams do not all pause together, and
# the router's loop reads each one's transcript in turn rather than all of them in one go.
MOVE_BATCH = 16
MOVE_PAUSE_SECONDS = 0.02


def may_move(request: Forwarding) -> bool:
    """Whether the stream would be continued if it were cut now (as router.forwarding.resume decides): nothing of
    the request or of the answer so far refuses a continuation. A move uses none of the stream's
    LLMGW_STREAM_MIGRATIONS: they bound what failing engines cost, and a drain is no failure."""
    transcript = request.transcript
    if transcript is None:
        return False
    if transcript.path:
        path, payload = transcript.path, transcript.payload
    else:  # the first leg: the request as the client sent it, read as the first break would read it
        path, payload = request.path, json.loads(request.body)
    if transcript.answer is not None:
        return refusal(path, payload, transcript.answer) is None
    # The first leg's events are read only if one of them may have begun a tool call or reasoning: reading them all
    # costs some 2 µs an event, a scan for these words a few µs a stream.
    kept = b"".join(transcript.kept)
    answer = read_answer(kept) if any(word in kept for word in _ANSWER_REFUSALS) else _NOTHING_YET
    return refusal(path, payload, answer) is None


class StreamMoves:
    """The continuable streams being relayed, by the replica relaying them, and the moves the endpoint table asks
    for.

    The relay writes `streams` itself, one dict entry a leg (no call: it is on every stream's way); a move reads
    them all, which happens once per replica leaving service.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.streams: dict[Forwarding, str] = {}  # continuable stream -> the replica relaying its leg now
        self.due: set[str] = set()  # replicas whose time has come: a stream that begins on one moves at once
        self._planned: dict[str, tuple[float, asyncio.TimerHandle]] = {}  # replica id -> (when, its timer)

    def begun_on_due(self, replica_id: str, request: Forwarding) -> None:
        """A stream's leg began on a replica whose time has come (the relay asks only when some has): move it."""
        if replica_id in self.due and may_move(request):
            request.exchange.move()

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
        """Move the continuable streams relayed from `replica_id`, now and as they begin, in batches (`_move`);
        returns how many were moved at once."""
        self._planned.pop(replica_id, None)
        self.due.add(replica_id)
        return self._move(replica_id, [request for request, on in self.streams.items() if on == replica_id])

    def _move(self, replica_id: str, streams: list[Forwarding]) -> int:
        """Move the first MOVE_BATCH of `streams` that may be moved now, the rest MOVE_PAUSE_SECONDS later (each
        judged when its turn comes); returns how many were moved now."""
        moved = 0
        while streams and moved < MOVE_BATCH:
            request = streams.pop()
            if self.streams.get(request) == replica_id and may_move(request):
                request.exchange.move()
                moved += 1
        if streams:
            asyncio.get_running_loop().call_later(MOVE_PAUSE_SECONDS, self._move, replica_id, streams)
        if moved:
            log.info(
                "replica %s is leaving service: moved %d of its streams, %d to go", replica_id, moved, len(streams)
            )
        return moved

    def close(self) -> None:
        """Cancel the timers (the router is stopping)."""
        for _, timer in self._planned.values():
            timer.cancel()
        self._planned.clear()
