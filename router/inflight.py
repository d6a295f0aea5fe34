"""The requests being proxied, watched by one sweep: an engine's first byte overdue, a client gone away.

Watching a request costs it a set entry and a few attribute writes, never a
timer: arming and cancelling one costs about 2 µs under uvloop (measured), and
aiohttp's read deadline re-arms one at every read. One sweep runs instead,
every SWEEP_SECONDS (or a quarter of the first-byte deadline, if that is
shorter) while any request is in flight, and does what timers would:

* A request still waiting for its engine's first byte past
  LLMGW_UPSTREAM_FIRST_BYTE_SECONDS (counted from when it was sent, connecting
  included) is cancelled with `timed_out` set; the proxy answers 504. The
  deadline takes effect between its time and two sweeps after.
* A request still running DISCONNECT_WATCH_DELAY after the sweep first saw it
  starts waiting on its `receive` for the client's disconnect, which cancels it
  so the upstream request stops with it. Most answers are over before that, and
  spare the task a watch costs.

The silence allowed between chunks once an answer has begun is aiohttp's own
read deadline, armed by the proxy only for answers still being read.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .asgi_io import Receive, until_disconnect
from .background import BackgroundTasks

# How long a request runs before the router starts watching for its client's disconnect (seconds).
DISCONNECT_WATCH_DELAY = 0.2
# The sweep's longest and shortest period (a short first-byte deadline shortens it, down to the least).
SWEEP_SECONDS = DISCONNECT_WATCH_DELAY / 2
MIN_SWEEP_SECONDS = 0.01


class Exchange:
    """One proxied request: how far it has got, for the sweep, and how it ended, for metrics and accounting.

    The proxy sets `awaiting` while an engine owes the first byte (and clears
    `due` at each attempt, so a retry has its own deadline). `key` is the API
    key's digest, for token accounting; `status` and `complete` are how the
    request ended. The request's task tells a cancellation by the sweep from
    any other by `deadline_passed()` and `client_gone()`.
    """

    # Defaults on the class: a request sets only what it has.
    status: int | None = None
    complete = False
    awaiting = False
    due: float | None = None  # loop time the first byte is due by, set by the sweep once it sees `awaiting`
    timed_out = False
    _seen_at: float | None = None
    _watch: asyncio.Task[None] | None = None
    _gone = False

    def __init__(self, key: str | None, receive: Receive, task: asyncio.Task[Any] | None) -> None:
        self.key = key
        self._receive = receive
        self._task = task

    def deadline_passed(self) -> bool:
        """Whether the sweep cancelled the request for an overdue first byte (taking the cancellation back)."""
        if self.timed_out and self._task is not None:
            self._task.uncancel()
            return True
        return False

    def client_gone(self) -> bool:
        """Whether the request was cancelled because its client left (taking the cancellation back)."""
        if self._gone and self._task is not None:
            self._task.uncancel()
            return True
        return False

    def swept(self, now: float, first_byte_timeout: float) -> None:
        """What the sweep does for this request at `now`: start its disconnect watch, or time it out, when due."""
        task = self._task
        if task is None or task.done() or self._gone or self.timed_out:
            return
        if self._seen_at is None:
            self._seen_at = now
        elif self._watch is None and now - self._seen_at >= DISCONNECT_WATCH_DELAY:
            self._watch = asyncio.ensure_future(self._wait_for_disconnect())
        if self.awaiting:
            if self.due is None:
                self.due = now + first_byte_timeout
            elif now >= self.due:
                self.timed_out = True
                task.cancel()

    async def _wait_for_disconnect(self) -> None:
        await until_disconnect(self._receive)
        task = self._task
        # A disconnect once the whole answer is sent is only the end of the exchange.
        if task is not None and not task.done() and not self.complete and not self.timed_out:
            self._gone = True
            task.cancel()

    def stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.cancel()


class InFlight:
    """The exchanges in flight, and the sweep that watches them while there are any (so an idle router keeps no
    timer)."""

    def __init__(self, tasks: BackgroundTasks, first_byte_timeout: float) -> None:
        if first_byte_timeout <= 0:
            raise ValueError("first_byte_timeout must be > 0")
        self._tasks = tasks
        self.first_byte_timeout = first_byte_timeout
        self.period = max(MIN_SWEEP_SECONDS, min(SWEEP_SECONDS, first_byte_timeout / 4))
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
                    exchange.swept(now, self.first_byte_timeout)
        finally:
            self._sweeping = None
