"""Budgets as reservations: the windows a budget's spend is counted in, and the one atomic step that admits a
request against every budget that applies to it.

A budget counts spend over a window aligned to its own time zone: a day from local midnight, a week from
Monday's, a month from the first's, or no window at all. Boundaries are local midnights turned into instants, so
a day may last 23 or 25 hours (daylight saving), and a midnight the clocks skip begins its day at the first
instant that exists (`window`).

A request must fit every budget that applies to it (its key's, its member's, its team's). Amounts are whole
micro-units of the currency, so sums are exact. `reserve` takes the request's worst-case cost from all of them at
once, or from none: if any would pass its limit the request is refused, naming the first that would. `settle`
puts back what the answer did not cost (or takes what it cost beyond the reservation). A reservation never
settled (its router died) expires after `ttl` seconds and stays charged at what it reserved: a budget may be
under-used by a lost router, never over-spent.

`InProcessBudgets` is the embedded mode's (one process, a lock); hub.redis_budgets keeps the same counters in
Redis for every router at once, one script per step.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

MICROS = 1_000_000  # micro-units in a unit of currency


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
    """One budget a request must fit: its counter (the budget and the window's start) and its limit, in
    micro-units."""

    counter: str
    limit: int


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request was refused: the first budget it would overrun, what that budget has spent and reserved,
    and its limit (micro-units)."""

    counter: str
    used: int
    limit: int


def counter_name(budget_id: int, start: datetime | None) -> str:
    """The counter of one budget in one window (a budget with no window has one counter)."""
    return f"{budget_id}:{int(start.timestamp()) if start is not None else 'all'}"


class InProcessBudgets:
    """The counters of one process (embedded mode): a lock makes each step atomic."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._used: dict[str, int] = {}
        # reservation id -> (amount, counters, expiry on `clock`)
        self._held: dict[str, tuple[int, tuple[str, ...], float]] = {}
        self._clock = clock

    def reserve(self, reservation: str, amount: int, limits: list[Limit], ttl: float) -> Refusal | None:
        """Take `amount` from every budget in `limits`, or from none; None if taken, else the first refusal."""
        with self._lock:
            self._forget_expired()
            for limit in limits:
                used = self._used.get(limit.counter, 0)
                if used + amount > limit.limit:
                    return Refusal(limit.counter, used, limit.limit)
            for limit in limits:
                self._used[limit.counter] = self._used.get(limit.counter, 0) + amount
            self._held[reservation] = (amount, tuple(limit.counter for limit in limits), self._clock() + ttl)
            return None

    def settle(self, reservation: str, cost: int) -> bool:
        """Charge the answer's real `cost` in place of what was reserved; False if the reservation is gone
        (expired: it stays charged as reserved)."""
        with self._lock:
            self._forget_expired()
            held = self._held.pop(reservation, None)
            if held is None:
                return False
            amount, counters, _ = held
            for counter in counters:
                self._used[counter] += cost - amount
            return True

    def used(self, counter: str) -> int:
        """What a budget's counter holds: spent and still reserved (micro-units)."""
        with self._lock:
            return self._used.get(counter, 0)

    def _forget_expired(self) -> None:
        now = self._clock()
        for reservation in [r for r, (_, _, expiry) in self._held.items() if expiry <= now]:
            del self._held[reservation]
