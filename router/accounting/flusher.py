"""Usage leaves the router here: one report to the hub per interval (DESIGN invariant 4).

Requests only stamp the ledger's in-memory maps (router.accounting.ledger, in the
same step as the pick); this flusher swaps the maps out once per `flush_seconds` and
hands them to the hub as one `UsageReport` — last-use stamps, per-model
in-flight peaks, requests and tokens per API key and model with each key's
last use (router.accounting.usage_reader), answers whose engine broke off per model
(router.accounting.continuations), each model's recent window (router.accounting.windows),
and this router's watch mark renewed — so the cost
follows time, replicas, keys and models, never traffic.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket

from hub.contracts import UsageExchange, UsageReport
from router.accounting.ledger import Ledger
from router.accounting.windows import RecentWindows
from router.background import raise_if_cancelling
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)


def new_router_id() -> str:
    """An id for this router process: readable (host, pid) and never reused (random), so a restart is a new watch."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


class UsageFlusher:
    """Moves the ledger's stamps and in-flight peaks to the hub and keeps this router's watch mark alive."""

    def __init__(
        self,
        hub: UsageExchange,
        ledger: Ledger,
        metrics: RouterMetrics,
        flush_seconds: float,
        router_id: str | None = None,
    ):
        if flush_seconds <= 0:
            raise ValueError("flush_seconds must be > 0")
        if router_id is not None and not router_id:
            raise ValueError("router_id must be a non-empty string")
        self.hub = hub
        self.ledger = ledger
        self.metrics = metrics
        self.flush_seconds = flush_seconds
        self.router_id = router_id or new_router_id()
        # Long enough to survive a late flush or two, short enough that a dead router is noticed.
        self.watch_ttl = max(3 * flush_seconds, 3.0)
        self._failing = False
        # What users felt of each model lately (router.accounting.windows); set once the proxy exists.
        self.windows: RecentWindows | None = None

    async def run(self) -> None:
        """Flush every `flush_seconds`, until cancelled."""
        await self._sync_limits(always=True)  # learn how many routers share each key's limits, before any request
        while True:
            await asyncio.sleep(self.flush_seconds)
            await self.flush()
            raise_if_cancelling()

    async def flush(self) -> bool:
        """Report what was used since the last flush and renew this router's mark; keep the stamps if refused.

        A router whose reports are delivered vouches that a replica without a
        stamp was not used through it. A failed report renews nothing, so the
        mark lapses and the control plane treats idleness as unknown. Peaks of
        a failed report are dropped: the next window starts at what is in
        flight then, and a past burst must not read as present load.
        """
        stamps, in_flight = self.ledger.take_usage()
        tokens, keys = self.ledger.tokens.take()
        report = UsageReport(
            router=self.router_id,
            stamps=stamps,
            in_flight=in_flight,
            ttl=self.watch_ttl,
            tokens=tokens,
            keys=keys,
            continuations=self.ledger.continuations.take(),
            records=self.ledger.take_records(),
            replica_tokens=self.ledger.tokens.take_replicas(),
            windows=self.windows.take() if self.windows is not None else {},
        )
        try:
            await self.hub.report_usage(report)
        except asyncio.CancelledError:
            self._restore(report)
            raise
        except Exception as exc:  # Redis down must never fail a request (DESIGN invariant 4)
            self._restore(report)
            self.metrics.usage_flush_failures.inc()
            if not self._failing:
                log.warning("could not report usage, keeping the stamps for the next flush: %s", exc)
                self._failing = True
            return False
        if self._failing:
            log.info("usage store is taking usage reports again")
            self._failing = False
        # Every flush, even with no limited key in use: the count of routers must be current before one is.
        await self._sync_limits(always=True)
        return True

    def _restore(self, report: UsageReport) -> None:
        """Keep what a report could not deliver for the next flush: stamps, and counts, which the hub adds up
        whenever they arrive. Its peaks are dropped (see `flush`)."""
        self.ledger.restore_stamps(report.stamps)
        self.ledger.tokens.restore(report.tokens, report.keys)
        self.ledger.tokens.restore_replicas(report.replica_tokens)
        self.ledger.continuations.restore(report.continuations)
        self.ledger.restore_records(report.records)

    async def _sync_limits(self, always: bool = False) -> None:
        """Hand the hub what limited keys used here; take back their totals over every router (router.accounting.limits)."""
        limits = self.ledger.limits
        if not limits.limited_keys() and not always:
            return
        minute, deltas = limits.take()
        try:
            totals, routers = await self.hub.sync_limits(minute, deltas)
        except asyncio.CancelledError:
            limits.restore(minute, deltas)
            raise
        except Exception as exc:  # the allowances in hand keep applying until the hub answers again
            limits.restore(minute, deltas)
            log.warning("could not share rate-limit counts: %s", exc)
            return
        limits.apply(minute, totals, routers)

    async def close(self) -> bool:
        """On clean shutdown: flush once more, then withdraw this router's mark.

        Only after a delivered flush: leaving with stamps undelivered would let
        the control plane read "not used" where the truth is unknown, so then
        the mark is left to lapse instead. Returns whether the router left.
        """
        if not await self.flush():
            return False
        try:
            await self.hub.leave(self.router_id)
        except Exception as exc:  # the mark lapses on its own
            log.warning("could not withdraw this router's watch mark, it will lapse: %s", exc)
            return False
        return True
