"""Usage and spend of the last 30 days by day and model, for the self-service pages: one SQL aggregation over the
hourly TokenUsage rows (whatever their number), a table, and the geometry of a bar chart the page draws as inline
SVG (no script: the pages work offline, as GPU clusters often are).

Days are UTC days, as the hourly rows are UTC hours. The chart shows spend when anything was charged in the window,
else tokens (a fleet without prices charges nothing), one bar a day stacked by model.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from django.db.models import QuerySet, Sum
from django.db.models.functions import TruncDate

from keys.budget_use import money
from keys.models import TokenUsage

DAYS = 30
"""The window: today (UTC) and the 29 days before it."""
PALETTE = ("#2563eb", "#16a34a", "#d97706", "#9333ea", "#dc2626", "#0891b2", "#db2777")
"""One colour per model, the most used first; models beyond them are drawn together as `OTHER`."""
OTHER = "other models"
OTHER_COLOUR = "#9ca3af"
SLOT, BAR, PLOT_HEIGHT, TOP, LEFT, BOTTOM = 22, 16, 140, 18, 8, 20
"""Chart geometry in px: a day's slot and its bar's width, the bars' height at the peak, and the margins."""


@dataclass(frozen=True)
class UsageLine:
    """What was used of one model on one day (or, with `day` None, over the whole window)."""

    day: date | None
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    spend_units: int

    @property
    def tokens(self) -> int:
        """Prompt and completion tokens together."""
        return self.prompt_tokens + self.completion_tokens

    @property
    def spend(self) -> str:
        """What it cost, in the currency unit, as text."""
        return money(self.spend_units)

    def __add__(self, other: UsageLine) -> UsageLine:
        return UsageLine(
            self.day if self.day == other.day else None,
            self.model if self.model == other.model else "",
            self.requests + other.requests,
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.spend_units + other.spend_units,
        )


@dataclass(frozen=True)
class Bar:
    """One model's part of one day's bar, in SVG coordinates, with its tooltip."""

    x: float
    y: float
    width: float
    height: float
    colour: str
    title: str


@dataclass(frozen=True)
class Label:
    """A day's label under its bar."""

    x: float
    y: float
    text: str


@dataclass(frozen=True)
class Chart:
    """A bar a day, stacked by model: what the page's inline SVG draws."""

    width: int
    height: int
    baseline: float
    measure: str
    """What the bars' height is: "spend" or "tokens"."""
    peak: str
    """The tallest bar's value, as text (the top of the scale)."""
    bars: list[Bar]
    labels: list[Label]
    legend: list[tuple[str, str]]
    """(model, colour), in stacking order."""


@dataclass(frozen=True)
class UsageReport:
    """The window's usage: by day and model (newest day first), by model, in total, and as a chart."""

    since: date
    lines: list[UsageLine]
    by_model: list[UsageLine]
    total: UsageLine
    chart: Chart


def usage_report(rows: QuerySet[TokenUsage], now: datetime) -> UsageReport:
    """The usage of `rows` (a filtered TokenUsage queryset: a user's keys, a team) in the `DAYS` days up to `now`.
    One query, summed in SQL by day and model."""
    since = now.astimezone(UTC).date() - timedelta(days=DAYS - 1)
    start = datetime(since.year, since.month, since.day, tzinfo=UTC)
    summed = (
        rows.filter(hour__gte=start)
        .annotate(day=TruncDate("hour", tzinfo=UTC))
        .values("day", "model")
        .annotate(r=Sum("requests"), p=Sum("prompt_tokens"), c=Sum("completion_tokens"), s=Sum("spend_units"))
        .order_by("-day", "model")
        .values_list("day", "model", "r", "p", "c", "s")
    )
    lines = [UsageLine(day, model, r or 0, p or 0, c or 0, s or 0) for day, model, r, p, c, s in summed]
    models: dict[str, UsageLine] = {}
    for line in lines:
        models[line.model] = models[line.model] + line if line.model in models else line
    by_model = sorted(models.values(), key=lambda m: (-m.spend_units, -m.tokens, m.model))
    total = sum(lines, UsageLine(None, "", 0, 0, 0, 0))
    return UsageReport(since, lines, [_whole_window(m) for m in by_model], total, _chart(lines, by_model, since))


def _whole_window(line: UsageLine) -> UsageLine:
    return UsageLine(None, line.model, line.requests, line.prompt_tokens, line.completion_tokens, line.spend_units)


def _chart(lines: list[UsageLine], by_model: list[UsageLine], since: date) -> Chart:
    """Stacked bars, a slot per day from `since`, the models coloured in `by_model`'s order (the rest as one)."""
    spend = any(line.spend_units for line in lines)
    value: Callable[[UsageLine], int] = (lambda line: line.spend_units) if spend else (lambda line: line.tokens)
    colours = {m.model: colour for m, colour in zip(by_model, PALETTE, strict=False)}
    stacks: dict[date, dict[str, UsageLine]] = defaultdict(dict)
    for line in lines:
        series = line.model if line.model in colours else OTHER
        held = stacks[line.day or since].get(series)
        stacks[line.day or since][series] = line if held is None else held + line
    peak = max((sum(value(part) for part in day.values()) for day in stacks.values()), default=0)
    order = [*colours, OTHER]
    bars: list[Bar] = []
    baseline = TOP + PLOT_HEIGHT
    for index in range(DAYS):
        day = since + timedelta(days=index)
        bottom = float(baseline)
        for series in (s for s in order if s in stacks.get(day, {})):
            part = stacks[day][series]
            height = round(PLOT_HEIGHT * value(part) / peak, 2) if peak else 0.0
            if not height:
                continue  # nothing to draw: its numbers are in the table
            bottom -= height
            colour = colours.get(series, OTHER_COLOUR)
            x = LEFT + index * SLOT + (SLOT - BAR) / 2
            bars.append(Bar(x, round(bottom, 2), BAR, height, colour, _title(day, series, part)))
    labels = [
        Label(LEFT + index * SLOT + SLOT / 2, baseline + BOTTOM - 5, f"{since + timedelta(days=index):%m-%d}")
        for index in range(DAYS - 1, -1, -7)
    ]
    legend = [(model, colour) for model, colour in colours.items()]
    if any(OTHER in day for day in stacks.values()):
        legend.append((OTHER, OTHER_COLOUR))
    measure = "spend" if spend else "tokens"
    peak_text = money(peak) if spend else f"{peak:,} tokens"
    return Chart(
        LEFT + DAYS * SLOT + LEFT, TOP + PLOT_HEIGHT + BOTTOM, baseline, measure, peak_text, bars, labels, legend
    )


def _title(day: date, series: str, part: UsageLine) -> str:
    requests = f"{part.requests:,} request{'' if part.requests == 1 else 's'}"
    return f"{day:%Y-%m-%d} {series}: {requests}, {part.tokens:,} tokens, {part.spend} spent"
