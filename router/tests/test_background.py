"""Shutdown ends the router's background tasks even when a client library swallows a cancellation."""

import asyncio
import logging

from router import background
from router.background import BackgroundTasks


class SwallowingLoop:
    """A loop like the endpoint poller whose store call turns the next `swallow` cancellations into normal replies."""

    def __init__(self, swallow: float):
        self.swallow = swallow
        self.ended = False

    async def run(self) -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if self.swallow <= 0:
                    self.ended = True
                    raise
                self.swallow -= 1
                asyncio.current_task().uncancel()


def test_a_task_that_swallowed_one_cancellation_is_cancelled_again_and_ends():
    loop = SwallowingLoop(swallow=1)

    async def scenario():
        tasks = BackgroundTasks()
        task = tasks.start(loop.run(), name="router-poll-endpoints")
        await asyncio.sleep(0)
        await asyncio.wait_for(tasks.cancel_all(), timeout=2)
        return task

    task = asyncio.run(scenario())
    assert loop.ended
    assert task.cancelled()


def test_a_task_that_never_ends_is_named_and_shutdown_goes_on(monkeypatch, caplog):
    monkeypatch.setattr(background, "CANCEL_PATIENCE_SECONDS", 0.3)
    monkeypatch.setattr(background, "RECANCEL_SECONDS", 0.05)
    loop = SwallowingLoop(swallow=float("inf"))

    async def scenario():
        tasks = BackgroundTasks()
        task = tasks.start(loop.run(), name="stubborn")
        await asyncio.sleep(0)
        with caplog.at_level(logging.WARNING, logger="router.background"):
            await asyncio.wait_for(tasks.cancel_all(), timeout=2)
        still_running = not task.done()
        loop.swallow = 0  # now let it go, so the test's own loop closes cleanly
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return still_running

    assert asyncio.run(scenario()) is True
    assert "background tasks still running after 0.3 s of cancelling: stubborn" in caplog.text
