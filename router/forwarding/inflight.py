"""The requests being proxied, watched by one sweep: an engine overdue, a client gone away.

Watching a request costs it a set entry and a few attribute writes, never a
timer: arming and cancelling one costs about 2 µs under uvloop (measured), and
a read deadline in aiohttp re-arms one at every read. One sweep runs instead,
every SWEEP_SECONDS (or a quarter of the shorter upstream deadline, if that is
less) while any request is in flight, and does what the timers would:

* A request whose engine owes it bytes past their deadline is cancelled with
  `overdue` naming the deadline; the proxy answers a 504 or ends the stream
  with an error event. The first byte is due LLMGW_UPSTREAM_FIRST_BYTE_SECONDS
  after the request was sent (connecting included); once the answer has begun,
  the next chunk LLMGW_UPSTREAM_IDLE_SECONDS after the last one was relayed
  (time spent sending to a slow client does not count). A deadline takes
  effect between its time and two sweeps after.
* A request still running DISCONNECT_WATCH_DELAY after the sweep first saw it
  starts waiting on its `receive` for the client's disconnect, which cancels it
  so the upstream request stops with it. Most answers are over before that, and
  spare the task a watch costs.
"""

from __future__ import annotations

import asyncio
from typing import Any

from router.background import BackgroundTasks
from router.forwarding.asgi_io import Receive, until_disconnect

# How long a request runs before the router starts watching for its client's disconnect (seconds).
DISCONNECT_WATCH_DELAY = 0.2
# The sweep's longest and shortest period (a short upstream deadline shortens it, down to the least).
SWEEP_SECONDS = DISCONNECT_WATCH_DELAY / 2
MIN_SWEEP_SECONDS = 0.01

# What an engine owes a request (Exchange.phase), each with its deadline.
FIRST_BYTE = "first byte"
NEXT_CHUNK = "next chunk"


class Exchange:
    """One proxied request: how far it has got, for the sweep, and how it ended, for metrics and accounting.

    The proxy says what it waits on with `wait(phase)`: FIRST_BYTE or
    NEXT_CHUNK while it waits on the engine, each wait timed afresh (an
    attempt sent, a chunk relayed), None while it does not (sending to the
    client). `key` is the API key's digest, for token accounting; `status` and
    `complete` are how the request ended. The request's task tells a
    cancellation by the sweep from any other by `engine_failed()` (or
    `deadline_passed()`) and `client_gone()`.
    """

    # Defaults on the class: a request sets only what it uses.
    status: int | None = None
    complete = False
    phase: str | None = None
    since: float | None = None  # loop time the sweep first saw the current wait (None: not seen yet)
    overdue: str | None = None  # the phase whose deadline passed: from the sweep's cancel until deadline_passed()
    _seen_at: float | None = None
    _watch: asyncio.Task[None] | None = None
    _gone = False

    def __init__(self, key: str | None, receive: Receive, task: asyncio.Task[Any] | None) -> None:
        self.key = key
        self._receive = receive
        self._task = task

    def wait(self, phase: str | None) -> None:
        """From now the request waits on the engine for `phase` (FIRST_BYTE, NEXT_CHUNK), its deadline
        counted from the next sweep; None: it waits on nothing the engine owes."""
        self.phase = phase
        self.since = None

    def engine_failed(self, exc: BaseException) -> bool:
        """Whether `exc`, raised while waiting on the engine, is the engine's failure: any error but a
        cancellation, and the sweep's cancellation for a passed deadline (taken back). False for any other
        cancellation, which the caller re-raises."""
        return not isinstance(exc, asyncio.CancelledError) or self.deadline_passed() is not None

    def deadline_passed(self) -> str | None:
        """The deadline (FIRST_BYTE, NEXT_CHUNK) the sweep cancelled the request for, taking that
        cancellation back (once: a later cancellation is not mistaken for it); None if it did not."""
        overdue = self.overdue
        if overdue is not None:
            self.overdue = self.phase = None  # the wait is over; a new one is watched afresh
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
        phase = self.phase
        if phase is None:
            return
        if self.since is None:
            self.since = now
        elif now - self.since >= (first_byte_timeout if phase == FIRST_BYTE else idle_timeout):
            self.overdue = phase
            task.cancel()

    async def _wait_for_disconnect(self) -> None:
        await until_disconnect(self._receive)
        task = self._task
        # A disconnect once the whole answer is sent is only the end of the exchange.
        if task is not None and not task.done() and not self.complete and self.overdue is None:
            self._gone = True
            task.cancel()

    def stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.cancel()


class InFlight:
    """The exchanges in flight, and the sweep that watches them while there are any (so an idle router keeps no
    timer)."""

    def __init__(self, tasks: BackgroundTasks, first_byte_timeout: float, idle_timeout: float) -> None:
        if first_byte_timeout <= 0 or idle_timeout <= 0:
            raise ValueError("first_byte_timeout and idle_timeout must be > 0")
        self._tasks = tasks
        self.first_byte_timeout = first_byte_timeout
        self.idle_timeout = idle_timeout
        self.period = max(MIN_SWEEP_SECONDS, min(SWEEP_SECONDS, first_byte_timeout / 4, idle_timeout / 4))
        self._exchanges: set[Exchange] = set()
        self._sweeping: asyncio.Task[None] | None = None

    def begin(self, key: str | None, receive: Receive) -> Exchange:
        """Watch the request the running task is serving from now on."""
        exchange = Exchange(key, receive, asyncio.current_task())
        self._exchanges.add(exchange)
        if self._sweeping is None:
            self._sweeping = self._tasks.start(self._sweep_while_busy(), name="router-in-flight-sweep")
        return exchange

    def end(self, exchange: Exchange) -> None:
        """The request is over: nothing more to watch."""
        self._exchanges.discard(exchange)
        exchange.stop_watching()

    def __len__(self) -> int:
        return len(self._exchanges)

    async def _sweep_while_busy(self) -> None:
        loop = asyncio.get_running_loop()
        exchanges = self._exchanges
        try:
            while exchanges:
                await asyncio.sleep(self.period)
                now = loop.time()
                for exchange in list(exchanges):
                    exchange.swept(now, self.first_byte_timeout, self.idle_timeout)
        finally:
            self._sweeping = None
