"""What each budget holds now: its current window (from the budget's time zone) and its counter's spend and
reservations in the hub (hub.budgets), read for many budgets in one round trip. The pages, the REST API, the
alerts and the metrics read budgets' use through here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal

from django.utils import timezone

from hub.budgets import SPEND_UNITS, Window, counter_name, window
from hub.contracts import BudgetReader
from keys.models import Budget


@dataclass(frozen=True)
class BudgetUse:
    """One budget in its current window: what it holds (spent and reserved, spend units) against its limit."""

    budget: Budget
    counter: str
    used: int
    start: datetime | None
    end: datetime | None

    @property
    def limit(self) -> int:
        """The budget's amount in spend units."""
        return int(self.budget.amount.scaleb(12))

    @property
    def used_amount(self) -> Decimal:
        """What it holds, in the currency unit."""
        return Decimal(self.used) / SPEND_UNITS

    def reached(self, percent: int) -> bool:
        """Whether it holds `percent` % of its amount or more (exactly: no float)."""
        return self.used * 100 >= self.limit * percent


def current_use(budgets: Sequence[Budget], hub: BudgetReader, now: datetime | None = None) -> list[BudgetUse]:
    """Each budget's use in the window holding `now` (default: now), in the order given; one hub round trip."""
    at = now or timezone.now()
    windows = [window(Window(budget.window), budget.timezone, at) for budget in budgets]
    counters = [counter_name(budget.pk, start) for budget, (start, _) in zip(budgets, windows, strict=True)]
    held = hub.budget_use(counters) if counters else {}
    return [
        BudgetUse(budget, counter, held.get(counter, 0), start, end)
        for budget, counter, (start, end) in zip(budgets, counters, windows, strict=True)
    ]


class NoCounters:
    """A reader that knows no counter (the hub does not answer): budgets' windows are still told from the budgets
    alone, and their use must be shown unknown, not zero."""

    def budget_use(self, counters: list[str]) -> dict[str, int]:
        return {}


_SHOWN = Decimal("0.000001")  # the smallest amount text shows, as budgets' amounts have six decimals


def money(units: int) -> str:
    """Spend units as an amount for people: six decimals at most, trailing zeros trimmed down to two (`12.50`,
    `0.000125`); `<0.000001` for a spend too small to show, so a little spent never reads as nothing."""
    value = (Decimal(units) / SPEND_UNITS).quantize(_SHOWN, rounding=ROUND_HALF_UP)
    if units > 0 and not value:
        return f"<{_SHOWN}"
    whole, _, fraction = f"{value:f}".partition(".")
    return f"{whole}.{fraction.rstrip('0').ljust(2, '0')}"
