"""The router's background tasks: started beside requests, cancelled together at shutdown.

The endpoint watcher, the backstop poller, the usage flusher, the engine load
poller (router.engine_load) and activation requests run here. Their loops call
`raise_if_cancelling()` after a failure they log, so a cancellation is never
mistaken for a store error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


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
        """Cancel every task and wait until each has ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def raise_if_cancelling() -> None:
    """Honour a cancellation that a store client turned into an error of its own.

    redis-py can answer a cancelled read with a connection error; a background
    loop that logs it and carries on would never end, and shutdown would hang.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
