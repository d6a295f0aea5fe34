"""Budgets as reservations: the windows a budget's spend is counted in, and the one atomic step that admits a
request against every budget that applies to it.

A budget counts spend over a window aligned to its own time zone: a day from local midnight, a week from
Monday's, a month from the first's, or no window at all. Boundaries are local midnights turned into instants, so
a day may last 23 or 25 hours (daylight saving), and a midnight the clocks skip begins its day at the first
instant that exists (`window`).

A request must fit every budget that applies to it (its key's, its member's, its team's). Amounts are whole
`SPEND_UNITS` (10^-12 of the currency unit: tokens times a price per million with six decimals), so every sum
is exact. `reserve` takes the request's worst-case cost from all of them at once, or from none: if any would
pass its limit the request is refused, naming the first that would. `settle` puts back what the answer did not
cost (or takes what it cost beyond the reservation) and, in the same step, adds the cost to the ledger (the
hub's spend per key, model and hour, which the control plane stores in keys.TokenUsage): the counters and the
ledger cannot disagree. A reservation never settled (its router died) expires after its `ttl` and is charged
at what it reserved, to the counters and the ledger alike (a request, no tokens): a lost router's answers are
never free, and a budget is never over-spent by them.

`InProcessBudgets` is the embedded mode's (one process, a lock); hub.redis_budgets keeps the same counters in
Redis for every router at once, one script per step.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Protocol
from zoneinfo import ZoneInfo

SPEND_UNITS = 10**12  # spend units in a unit of currency (keys.models.SPEND_UNITS)


class Window(enum.StrEnum):
    """How often a budget starts again."""

    DAY = "day"
    WEEK = "week"
    MONTH = "month"
    NONE = "none"


def window(kind: Window, zone: str, now: datetime) -> tuple[datetime | None, datetime | None]:
    """(start, end) of the window of `kind` in time zone `zone` holding the instant `now` (aware), as UTC
    instants; (None, None) for a budget with no window."""
    if kind is Window.NONE:
        return None, None
    tz = ZoneInfo(zone)
    local = now.astimezone(tz)
    day = local.date()
    if kind is Window.DAY:
        first, following = day, day + timedelta(days=1)
    elif kind is Window.WEEK:
        first = day - timedelta(days=day.weekday())
        following = first + timedelta(days=7)
    else:
        first = day.replace(day=1)
        following = (first + timedelta(days=32)).replace(day=1)
    return _midnight(first, tz), _midnight(following, tz)


def _midnight(day: date, tz: ZoneInfo) -> datetime:
    """The first instant of `day` in `tz`, in UTC. A local midnight the clocks skip reads with the offset before
    the change (zoneinfo's fold=0), which lands on the first instant that exists."""
    local = datetime(day.year, day.month, day.day, tzinfo=tz)
    return local.astimezone(UTC)


@dataclass(frozen=True, slots=True)
class Limit:
    """One budget a request must fit: its counter (the budget and the window's start), its limit (spend units)
    and how long its counter is kept (seconds; 0 = for ever, a budget with no window)."""

    counter: str
    limit: int
    keep: int = 0


@dataclass(frozen=True, slots=True)
class Reservation:
    """A request's worst-case cost (spend units) held against `limits` until it is settled or `ttl` (seconds)
    passes; `ledger` is "<key digest> <model>", where its cost is counted (hub.contracts.TokenCounts)."""

    id: str
    amount: int
    limits: Sequence[Limit]
    ttl: float
    ledger: str


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request was refused: the first budget it would overrun, what that budget has spent and reserved,
    and its limit (spend units)."""

    counter: str
    used: int
    limit: int


def counter_name(budget_id: int, start: datetime | None) -> str:
    """The counter of one budget in one window (a budget with no window has one counter)."""
    return f"{budget_id}:{int(start.timestamp()) if start is not None else 'all'}"


# (hour, "<digest> <model>", spend, requests): a charge for the ledger (a settlement, or an expired reservation).
Charge = Callable[[int, str, int, int], None]


class InProcessBudgets:
    """The counters of one process (embedded mode): a lock makes each step atomic. `charge` adds to the ledger
    (hub.memory.MemoryHub's token counts); `clock` is monotonic, `wall` tells the hour of an expiry's charge."""

    def __init__(
        self,
        charge: Charge | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._lock = threading.Lock()
        self._used: dict[str, int] = {}
        # counter -> when it may be forgotten (on `clock`), as Redis EXPIREs it: its window is over by then
        self._kept: dict[str, float] = {}
        # reservation id -> (reservation, expiry on `clock`); kept in the order made, so expired ones come first
        # for reservations of one TTL (a router's).
        self._held: dict[str, tuple[Reservation, float]] = {}
        self._charge = charge or (lambda hour, ledger, spend, requests: None)
        self._clock = clock
        self._wall = wall

    def reserve(self, reservation: Reservation) -> Refusal | None:
        """Take the reservation's amount from every budget of its limits, or from none; None if taken, else the
        first refusal."""
        amount = reservation.amount
        with self._lock:
            self._expire()
            for limit in reservation.limits:
                used = self._used.get(limit.counter, 0)
                if used + amount > limit.limit:
                    return Refusal(limit.counter, used, limit.limit)
            now = self._clock()
            for limit in reservation.limits:
                self._used[limit.counter] = self._used.get(limit.counter, 0) + amount
                if limit.keep:
                    self._kept[limit.counter] = now + limit.keep
            self._held[reservation.id] = (reservation, now + reservation.ttl)
            return None

    def settle(self, reservation_id: str, cost: int, hour: int) -> bool:
        """Charge the answer's real `cost` in place of what was reserved, to the counters and the ledger (in
        `hour`); False if the reservation is gone (expired, and charged as reserved)."""
        with self._lock:
            self._expire()
            held = self._held.pop(reservation_id, None)
            if held is None:
                return False
            reservation = held[0]
            for limit in reservation.limits:
                self._used[limit.counter] += cost - reservation.amount
            if cost:
                self._charge(hour, reservation.ledger, cost, 0)
            return True

    def used(self, counter: str) -> int:
        """What a budget's counter holds: spent and still reserved (spend units)."""
        with self._lock:
            return self._used.get(counter, 0)

    def sweep(self) -> None:
        """Charge the reservations expired by now (each step does it too), and forget the counters kept past their
        window (the tick sweeps before each take, so an embedded process holds only the windows in use)."""
        with self._lock:
            self._expire()
            now = self._clock()
            for counter in [c for c, until in self._kept.items() if until <= now]:
                del self._kept[counter]
                self._used.pop(counter, None)

    def _expire(self) -> None:
        now = self._clock()
        expired = []
        for reservation, expiry in self._held.values():
            if expiry > now:
                break  # the rest were made later (one TTL in a process)
            expired.append(reservation)
        if not expired:
            return
        hour = int(self._wall() // 3600) * 3600
        for reservation in expired:
            del self._held[reservation.id]
            # Charged as reserved: a request, its worst case, no tokens known.
            self._charge(hour, reservation.ledger, reservation.amount, 1)


class BudgetCounters(Protocol):
    """Budgets' counters shared by every router (hub.budgets): a reservation at admission, a settlement at the
    answer's end, each one atomic step (one Redis round trip)."""

    async def reserve_budget(self, reservation: Reservation) -> Refusal | None:
        """Take the reservation's worst case from every budget of its limits, or from none: None if taken, else
        the first budget it would overrun."""
        ...

    async def settle_budget(self, reservation_id: str, cost: int, hour: int) -> bool:
        """Charge the answer's real `cost` (spend units) in place of its reservation, to the counters and to the
        ledger's `hour`; False if the reservation had expired (then charged at what it reserved)."""
        ...


class BudgetReader(Protocol):
    """What the control plane reads of the budgets' counters (alerts, pages, metrics)."""

    def budget_use(self, counters: list[str]) -> dict[str, int]:
        """What each counter holds (spent and still reserved, spend units); 0 for one never used. One round trip."""
        ...
