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

from router.background import BackgroundTasks
from router.forwarding.asgi_io import Receive
from router.forwarding.exchange import DISCONNECT_WATCH_DELAY, Exchange

# The sweep's longest and shortest period (a short upstream deadline shortens it, down to the least).
SWEEP_SECONDS = DISCONNECT_WATCH_DELAY / 2
MIN_SWEEP_SECONDS = 0.01


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
