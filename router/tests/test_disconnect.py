"""A request's disconnect watch starts once it has run the delay, from one sweep, never for a request already over."""

import asyncio

from router.background import BackgroundTasks
from router.disconnect import DISCONNECT_WATCH_DELAY, DisconnectWatches


class Watch:
    """Stands in for a DisconnectWatch: records when it was started."""

    def __init__(self):
        self.started_at: float | None = None

    def start(self):
        self.started_at = asyncio.get_running_loop().time()


def test_only_requests_still_running_after_the_delay_get_a_watch_and_the_sweep_then_ends():
    async def scenario():
        tasks = BackgroundTasks()
        watches = DisconnectWatches(tasks)
        loop = asyncio.get_running_loop()
        began = loop.time()
        quick, slow = Watch(), Watch()
        watches.add(quick)
        watches.add(slow)
        await asyncio.sleep(DISCONNECT_WATCH_DELAY / 4)
        watches.discard(quick)  # answered before the delay: never watched
        await asyncio.sleep(DISCONNECT_WATCH_DELAY * 1.5)
        sweeping_after = len(asyncio.all_tasks()) - 1  # the sweep, if still running (this task aside)
        await tasks.cancel_all()
        return began, quick, slow, sweeping_after

    began, quick, slow, sweeping_after = asyncio.run(scenario())
    assert quick.started_at is None
    assert DISCONNECT_WATCH_DELAY <= slow.started_at - began <= DISCONNECT_WATCH_DELAY * 1.5 + 0.05
    assert sweeping_after == 0  # nothing waits any more: no timer left behind
