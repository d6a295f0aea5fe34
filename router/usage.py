"""Last-use stamps leave the router here: one flush to the hub per interval (DESIGN invariant 4).

Requests only stamp the balancer's in-memory map (under the lock the pick
already takes); this flusher swaps the map out once per `flush_seconds` and
hands it to the hub, so the cost follows time and replicas, never traffic.
"""

from __future__ import annotations

import asyncio
import logging

from hub.contracts import UsageSink

from .background import raise_if_cancelling
from .balancer import Balancer
from .metrics import RouterMetrics

log = logging.getLogger(__name__)


class UsageFlusher:
    """Moves the balancer's last-use stamps to the hub and keeps the hub's watch mark alive."""

    def __init__(self, hub: UsageSink, balancer: Balancer, metrics: RouterMetrics, flush_seconds: float):
        if flush_seconds <= 0:
            raise ValueError("flush_seconds must be > 0")
        self.hub = hub
        self.balancer = balancer
        self.metrics = metrics
        self.flush_seconds = flush_seconds
        # Long enough to survive a late flush or two, short enough that a dead router is noticed.
        self.watch_ttl = max(3 * flush_seconds, 3.0)
        self._failing = False

    async def run(self) -> None:
        """Flush every `flush_seconds`, until cancelled."""
        while True:
            await asyncio.sleep(self.flush_seconds)
            await self.flush()
            raise_if_cancelling()

    async def flush(self) -> bool:
        """Hand the stamps gathered since the last flush to the hub; keep them if it refuses.

        Then renew the hub's "watching" mark: a router whose stamps are being
        delivered vouches that a replica without a stamp was not used. A failed
        flush renews nothing, so the mark lapses and unused means unknown again.
        """
        stamps = self.balancer.take_stamps()
        try:
            if stamps:
                await self.hub.record_usage(stamps)
            await self.hub.keep_watching(self.watch_ttl)
        except asyncio.CancelledError:
            self.balancer.restore_stamps(stamps)
            raise
        except Exception as exc:  # Redis down must never fail a request (DESIGN invariant 4)
            self.balancer.restore_stamps(stamps)
            self.metrics.usage_flush_failures.inc()
            if not self._failing:
                log.warning("could not record last-use stamps, keeping them for the next flush: %s", exc)
                self._failing = True
            return False
        if self._failing:
            log.info("usage store is taking last-use stamps again")
            self._failing = False
        return True
