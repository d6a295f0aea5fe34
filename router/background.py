"""The router's background tasks: started beside requests, cancelled together at shutdown.

The endpoint watcher, the backstop poller, the usage flusher, the engine load
poller (router.picking.engine_load) and activation requests run here. Their loops call
`raise_if_cancelling()` after a failure they log, so a cancellation is never
mistaken for a store error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)

# How often, and for how long, shutdown cancels a task that has not ended yet.
RECANCEL_SECONDS = 0.25
CANCEL_PATIENCE_SECONDS = 5.0


class BackgroundTasks:
    """The tasks one router runs outside any request; a finished task forgets itself."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def start(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        """Run `coro` on the running loop, holding a reference so it is not collected mid-flight."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel_all(self) -> None:
        """Cancel every task and wait until each has ended, within CANCEL_PATIENCE_SECONDS.

        A client library can swallow a cancellation (redis-py has answered one with
        a normal reply), after which the loop would sleep and carry on for ever and
        shutdown would hang: a task still running is cancelled again until it ends.
        """
        pending = set(self._tasks)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CANCEL_PATIENCE_SECONDS
        while pending and loop.time() < deadline:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=RECANCEL_SECONDS)
        if pending:
            names = ", ".join(sorted(task.get_name() for task in pending))
            log.warning("background tasks still running after %g s of cancelling: %s", CANCEL_PATIENCE_SECONDS, names)


def raise_if_cancelling() -> None:
    """Honour a cancellation that a store client turned into an error of its own.

    redis-py can answer a cancelled read with a connection error; a background
    loop that logs it and carries on would never end, and shutdown would hang.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
