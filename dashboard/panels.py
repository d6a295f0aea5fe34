"""What the dashboard panels add to the cluster summary: human times, short ids, failed replicas, usage.

The figures of record stay in `dashboard.summary.cluster_summary()` (DESIGN
invariant 6); this module only reads two more things the panels show, each in
one query whatever the fleet size — failed replicas with their last error, and
per-model token usage over the last hour (`keys.models.TokenUsage`) — and
turns seconds and timestamps into text an operator reads at a glance
("3 min ago", "in 40 s"). Unknown stays unknown: `-`, never zero (DESIGN
invariant 3).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Sum
from django.utils import timezone

from dashboard.status_text import FELT_HEADERS, STAGE_HEADERS, felt_row, stage_row
from dashboard.summary_types import ClusterSummary
from keys.models import TokenUsage
from reconciler.choices import ReplicaState
from reconciler.models import Replica

SHORT_ID_LENGTH = 8
JUST_NOW_SECONDS = 5
CHART_WIDTH = 240
"""Width in px of the longest bar of the usage chart; the others scale to it."""
CHART_BAR_HEIGHT = 14


def humanize_duration(seconds: float | None) -> str:
    """A duration as `42 s`, `3 min`, `2 h 5 min`, `1 d 4 h`; `-` when unknown (None or negative)."""
    if seconds is None or seconds < 0:
        return "-"
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min"
    if whole < 86400:
        hours, minutes = divmod(whole // 60, 60)
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(whole // 3600, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def _as_datetime(value: datetime | str | None) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(value)


def humanize_ago(value: datetime | str | None, now: datetime) -> str:
    """A moment relative to `now`: `just now`, `3 min ago`, `in 40 s`; `-` when unknown.

    Takes a datetime or the summary's ISO strings, so templates need not parse.
    """
    when = _as_datetime(value)
    if when is None:
        return "-"
    delta = (now - when).total_seconds()
    if abs(delta) < JUST_NOW_SECONDS:
        return "just now"
    if delta < 0:
        return f"in {humanize_duration(-delta)}"
    return f"{humanize_duration(delta)} ago"


def short_id(value: str | None, length: int = SHORT_ID_LENGTH) -> dict:
    """`{"short", "full"}`: the first `length` characters (with `…` when cut) and the whole, for a title."""
    full = value or ""
    return {"short": full if len(full) <= length else full[:length] + "…", "full": full}


def failed_replicas(now: datetime) -> list[dict]:
    """FAILED replicas with why (`last_error`), how often, and when the next attempt is due. One query."""
    rows = (
        Replica.objects.filter(state=ReplicaState.FAILED)
        .order_by("id")
        .values("id", "model__name", "last_error", "failure_count", "next_attempt_at")
    )
    return [
        {
            "id": row["id"],
            "model": row["model__name"],
            "error": row["last_error"] or "-",
            "failures": row["failure_count"],
            "retry": _retry(row["next_attempt_at"], now),
        }
        for row in rows
    ]


def _retry(next_attempt_at: datetime | None, now: datetime) -> str:
    # Past due reads "due" (the next tick retries it), not "2 min ago", which looks like a retry that happened.
    if next_attempt_at is not None and next_attempt_at <= now:
        return "due"
    return humanize_ago(next_attempt_at, now)


def usage_window_start(now: datetime) -> datetime:
    """The first hourly bucket inside the last hour: usage is counted per hour, so the window is whole buckets."""
    return (now - timedelta(hours=1)).replace(minute=0, second=0, microsecond=0)


def usage_by_model(now: datetime) -> dict:
    """Requests and tokens per model since `usage_window_start`, with bar widths for an SVG chart. One query.

    `{"since", "rows": [{"model", "requests", "tokens", "requests_width", "tokens_width", "y"}], "height"}`,
    busiest model (most tokens) first.
    """
    since = usage_window_start(now)
    totals = (
        TokenUsage.objects.filter(hour__gte=since)
        .values("model")
        .annotate(requests=Sum("requests"), prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"))
        .order_by("model")
    )
    rows: list[dict[str, Any]] = [
        {"model": t["model"], "requests": t["requests"] or 0, "tokens": (t["prompt"] or 0) + (t["completion"] or 0)}
        for t in totals
    ]
    rows.sort(key=lambda r: (-r["tokens"], r["model"]))
    top_requests = max((r["requests"] for r in rows), default=0)
    top_tokens = max((r["tokens"] for r in rows), default=0)
    # Two bars per model (requests above, tokens below), each scaled to its own busiest model.
    step = 2 * CHART_BAR_HEIGHT + 8
    for i, row in enumerate(rows):
        row["requests_width"] = _width(row["requests"], top_requests)
        row["tokens_width"] = _width(row["tokens"], top_tokens)
        row["y"] = i * step
        row["y2"] = i * step + CHART_BAR_HEIGHT
    return {
        "since": since,
        "rows": rows,
        "height": max(len(rows) * step - 8, 0),
        "width": CHART_WIDTH,
        "bar_height": CHART_BAR_HEIGHT,
    }


def _width(value: int, top: int) -> int:
    # A model with any traffic gets at least a sliver, so it never looks idle next to a busy one.
    if not top or not value:
        return 0
    return max(1, round(CHART_WIDTH * value / top))


def panel_extras(summary: ClusterSummary, now: datetime | None = None) -> dict:
    """Template context the panels add to the summary: human times, the short leader id, failed, usage, the
    start of the continuations' window as a datetime, and what users felt and the stages as ctl_status prints them."""
    now = now or timezone.now()
    leader = summary.leader
    lease = None
    if leader is not None:
        expires = leader.expires_in_seconds
        lease = {
            "id": short_id(leader.owner),
            "epoch": leader.epoch,
            "expired": expires < 0,
            "when": humanize_ago(now + timedelta(seconds=expires), now),
        }
    return {
        "generated": humanize_ago(summary.generated_at, now),
        "lease": lease,
        "failed": failed_replicas(now),
        "usage_chart": usage_by_model(now),
        "usage_since": humanize_ago(summary.usage.since, now),
        "continuations_since": _as_datetime(summary.continuations.since),
        "felt_headers": FELT_HEADERS,
        "felt_rows": [(felt_row(model), model) for model in summary.felt],
        "felt_window": f"{settings.LLMGW_LATENCY_WINDOW_SECONDS:g} s",
        "stage_headers": STAGE_HEADERS,
        "stage_rows": [(stage_row(stage), stage) for stage in summary.staging],
    }
