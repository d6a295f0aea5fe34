"""Draining one engine: wait until it holds no requests, or a timeout passes, before it is stopped.

DESIGN "Stopping is always a drain": unpublish, wait until the engine reports
no running requests (or a timeout), then stop. The control plane has already
taken the replica out of the endpoint table when it sends `drain_shard`, so
no new requests arrive; this waits for the ones in flight. A count that cannot
be read is not known to be zero (DESIGN invariant 3), so it keeps the wait
going until the timeout. agent/runtime.py stops the engine afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

DRAIN_POLL_SECONDS = 0.5

DRAINED = "drained: no running requests"
INTERRUPTED = "drain cut short by a stop"
ENGINE_GONE = "engine exited while draining"


def timed_out(timeout: float, running: int | None) -> str:
    """Why a drain ended at its timeout, with what the engine last said it held."""
    held = "an unknown number of requests" if running is None else str(running)
    return f"drain timed out after {timeout:g} s with {held} running"


async def wait_until_idle(
    read: Callable[[], Awaitable[int | None]],
    timeout: float,
    interrupted: asyncio.Event,
    alive: Callable[[], bool],
    poll_seconds: float = DRAIN_POLL_SECONDS,
) -> str:
    """Poll `read()` until it says 0, `timeout` passes, `interrupted` is set or `alive()` is false; return why.

    The engine is read at least once, so a drain with a zero timeout still
    tells an idle engine from a busy one.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        if interrupted.is_set():
            return INTERRUPTED
        if not alive():
            return ENGINE_GONE
        running = await read()
        if running == 0:
            return DRAINED
        remaining = deadline - loop.time()
        if remaining <= 0:
            return timed_out(timeout, running)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(interrupted.wait(), min(poll_seconds, remaining))
