"""One proxied request: what every attempt of it sends (Forwarding), and its exchange with the engine as the
in-flight sweep (router.forwarding.inflight) sees it: which deadline runs, and how the request ended.

The engine owes a request its first byte from the moment an attempt is sent,
then each next chunk from the moment the last one was relayed; while the
router sends to the client, nothing is owed (a slow client's time is not the
engine's silence). The proxy says which of these holds with
`start_first_byte_deadline()`, `start_next_chunk_deadline()` and
`stop_deadline()`: each costs two attribute writes, and the sweep, not a
timer, cancels the request's task when a deadline passes. The task then tells
that cancellation apart from any other with `engine_failed()` (or
`deadline_passed()`) and `client_gone()`. A stream the control plane asks to
move off its replica (router.forwarding.moves) is cut the same way, only
while it waits on its engine, and `failure()` names that cut ReplicaLeaving.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router.accounting.budgets import Hold
from router.endpoints.table import Endpoint
from router.errors import ReplicaLeaving
from router.forwarding.asgi_io import Receive, Scope, Send, until_disconnect
from router.forwarding.transcript import Transcript
from router.picking.affinity import Prefix
from router.picking.fair_queue import Waiting
from router.picking.shares import Use

if TYPE_CHECKING:
    from router.key_cache import KeyInfo

# How long a request runs before the router starts watching for its client's disconnect (seconds).
DISCONNECT_WATCH_DELAY = 0.2

# The deadlines an engine can be under (Exchange.deadline), named in a 504's message and in the log.
FIRST_BYTE = "first byte"
NEXT_CHUNK = "next chunk"
# Not a deadline but cut like one: the control plane asked for the stream to move off its replica (Exchange.move).
MOVE = "move"


class Exchange:
    """One proxied request: the deadline it is under, for the sweep, and how it ended, for metrics and accounting.

    `key` is the API key's digest, for token accounting; `status` and
    `complete` are how the request ended.
    """

    # Defaults on the class: a request sets only what it uses.
    status: int | None = None
    complete = False
    deadline: str | None = None  # FIRST_BYTE, NEXT_CHUNK, or None while the engine owes nothing
    since: float | None = None  # loop time the sweep first saw the current deadline (None: not seen yet)
    overdue: str | None = None  # the deadline that passed (or MOVE): from the sweep's cancel until deadline_passed()
    moving = False  # a move was asked for: the stream is cut the next time it waits on its engine
    hold: Hold | None = None  # its budgets' reservation (router.accounting.budgets), settled when it ends
    settled = False  # settled already, before the answer's last byte (router.forwarding.relay)
    usage: tuple[int, int] | None = None  # (prompt, completion) tokens of its answer, once counted
    _seen_at: float | None = None
    _watch: asyncio.Task[None] | None = None
    _gone = False

    def __init__(self, key: str | None, receive: Receive, task: asyncio.Task[Any] | None) -> None:
        self.key = key
        self._receive = receive
        self._task = task

    def start_first_byte_deadline(self) -> None:
        """An attempt was sent: the engine owes its first byte within the first-byte deadline, timed afresh."""
        self.deadline = FIRST_BYTE
        self.since = None

    def start_next_chunk_deadline(self) -> None:
        """The answer began, or a chunk was relayed: the engine owes the next within the idle deadline, timed afresh."""
        self.deadline = NEXT_CHUNK
        self.since = None

    def stop_deadline(self) -> None:
        """The engine owes nothing now (the router is sending, holding, or done reading)."""
        self.deadline = None
        self.since = None

    def engine_failed(self, exc: BaseException) -> bool:
        """Whether `exc`, raised while the engine owed bytes, is the engine's failure: any error but a
        cancellation, and the sweep's cancellation for a passed deadline (taken back). False for any other
        cancellation, which the caller re-raises."""
        return self.failure(exc) is not None

    def failure(self, exc: BaseException) -> BaseException | None:
        """What `exc`, raised while the engine owed bytes, ends the leg with: `exc` itself for the engine's failure
        (as `engine_failed`), ReplicaLeaving for a move's cancellation, None for any other cancellation."""
        if not isinstance(exc, asyncio.CancelledError):
            return exc
        passed = self.deadline_passed()
        if passed is None:
            return None
        return ReplicaLeaving() if passed == MOVE else exc

    def move(self) -> None:
        """Cut the stream off its replica the next time it waits on its engine (now, if it waits now), as the sweep
        cuts one past its deadline: never while a chunk is being sent, so the client gets whole chunks only."""
        self.moving = True
        self._cut_if_moving()

    def _cut_if_moving(self) -> None:
        task = self._task
        if self.deadline == NEXT_CHUNK and task is not None and not task.done() and self.overdue is None:
            self.moving, self.overdue = False, MOVE
            task.cancel()

    def deadline_passed(self) -> str | None:
        """The deadline (FIRST_BYTE, NEXT_CHUNK, or MOVE) the sweep cancelled the request for, taking that
        cancellation back (once: a later cancellation is not mistaken for it); None if it did not."""
        overdue = self.overdue
        if overdue is not None:
            self.overdue = self.deadline = None  # the wait is over; a new one is watched afresh
            if self._task is not None:
                self._task.uncancel()
        return overdue

    def client_gone(self) -> bool:
        """Whether the request was cancelled because its client left (taking the cancellation back)."""
        if self._gone and self._task is not None:
            self._task.uncancel()
            return True
        return False

    def swept(self, now: float, first_byte_timeout: float, idle_timeout: float) -> None:
        """What the sweep does for this request at `now`: start its disconnect watch, or time it out, when due."""
        task = self._task
        if task is None or task.done() or self._gone or self.overdue is not None:
            return
        if self._seen_at is None:
            self._seen_at = now
        elif self._watch is None and now - self._seen_at >= DISCONNECT_WATCH_DELAY:
            self._watch = asyncio.ensure_future(self._wait_for_disconnect())
        deadline = self.deadline
        if deadline is None:
            return
        if self.moving and deadline == NEXT_CHUNK:
            self._cut_if_moving()
            return
        if self.since is None:
            self.since = now
        elif now - self.since >= (first_byte_timeout if deadline == FIRST_BYTE else idle_timeout):
            self.overdue = deadline
            task.cancel()

    async def _wait_for_disconnect(self) -> None:
        await until_disconnect(self._receive)
        task = self._task
        # A disconnect once the whole answer is sent is only the end of the exchange.
        if task is not None and not task.done() and not self.complete and self.overdue is None:
            self._gone = True
            task.cancel()

    def stop_watching(self) -> None:
        """Cancel the disconnect watch, if one was started (the request is over)."""
        if self._watch is not None:
            self._watch.cancel()


@dataclass(slots=True, eq=False)
class Forwarding:
    """One request on its way to a replica: what every attempt sends, and how far the request has got.

    `affinity` and `pools` go to every pick of the request (Picker.pick).
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
    held: bool = False  # held once already for a replacement replica (Proxy._replacement)
    received: float = 0.0
    tried: list[Endpoint] = field(default_factory=list)
    transcript: Transcript | None = None  # a stream that may be continued elsewhere if its engine breaks off
    resent: int = 0  # times its whole answer broke off before it was sent, and the request went to another replica
    key: KeyInfo | None = None  # whose it is: its tenant, class and weight in a full model's fair queue
    admitted: Use | None = None  # its tenant's and class's count on a model with a capacity, while it runs there
    waited: Waiting | None = None  # its place in a full model's fair queue, once it left it
    queue_wait: bytes | None = None  # how long it waited there (seconds), for its answer's header
