"""The embedded reconcile ticker: the tick every LLMGW_TICK_SECONDS, or at once when there is work.

In distributed mode Celery beat sets the cadence; here a loop does, and it is
woken early by a router's activation request (through the in-process hub) or
by a commit that left work for the next tick (reconciler.signals.work_pending).
"""

from __future__ import annotations

import asyncio
import logging
import threading

from asgiref.sync import sync_to_async
from django.conf import settings

from hub import ControlPlaneHub, InProcessHub
from reconciler.leadership.lease import get_leadership
from reconciler.signals import work_pending
from reconciler.tick import tick

log = logging.getLogger("llmgw.up")


class Ticker:
    """Runs ticks until stopped; `wake()` (any thread) brings the next one forward."""

    def __init__(self, hub: ControlPlaneHub):
        self.hub = hub
        self._wake = threading.Event()
        self._stopping = False
        if isinstance(hub, InProcessHub):
            hub.on_activation(self.wake)

    def wake(self, **_signal_kwargs) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Tick until `stop()`, then release the lease so another control plane can lead at once."""
        leadership = get_leadership()
        run_tick = sync_to_async(tick)
        work_pending.connect(self.wake, weak=False, dispatch_uid=id(self))
        try:
            while not self._stopping:
                self._wake.clear()
                try:
                    await run_tick(leadership=leadership, hub=self.hub)
                except Exception:  # a failed tick is retried on the next one, never fatal
                    log.exception("reconcile tick failed")
                await asyncio.to_thread(self._wake.wait, settings.LLMGW_TICK_SECONDS)
        finally:
            work_pending.disconnect(dispatch_uid=id(self))
            await sync_to_async(leadership.release)()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
