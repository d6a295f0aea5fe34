"""Who leads, sampled four times a second from the lease row, so leadership changes can be counted."""

from __future__ import annotations

import threading
import time

from django.conf import settings
from django.db import connection

from reconciler.models import Lease


class LeaseMonitor:
    """Records (monotonic time, owner, epoch) whenever the lease row changes hands."""

    def __init__(self, interval: float = 0.25):
        self.interval = interval
        self.changes: list[tuple[float, str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drill-lease-monitor", daemon=True)

    def start(self) -> LeaseMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    row = Lease.objects.filter(name=settings.LLMGW_LEASE_NAME).values_list("owner", "epoch").first()
                except Exception:  # the database is down for a fault: no sample
                    connection.close()
                    row = None
                if row is not None and (not self.changes or self.changes[-1][1:] != row):
                    self.changes.append((time.monotonic(), row[0], row[1]))
                self._stop.wait(self.interval)
        finally:
            connection.close()

    @property
    def owner(self) -> tuple[str, int] | None:
        return self.changes[-1][1:] if self.changes else None

    def changes_between(self, start: float, end: float) -> int:
        return sum(1 for at, _, _ in self.changes if start <= at < end)

    def first_change_after(self, start: float) -> float | None:
        return next((at for at, _, _ in self.changes if at > start), None)
