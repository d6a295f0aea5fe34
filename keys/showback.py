"""Showback: each team's share of the GPU time the fleet spent, attributed replica by replica and hour by hour
by the team's share of the tokens that replica served in that hour.

The whole to divide is `GpuHour` (a replica's awake GPUs times the seconds it held them, reconciler.demand.gpu_time);
the shares are `ReplicaTokens` (tokens per replica, key and hour, as the routers counted them, with the key's team
then). A replica's hour with no tokens is *idle*: GPU time spent keeping a model ready that nobody used in that
hour, reported per model rather than charged to a team. Keys of no team are reported together as team None.

Why tokens and not requests: a long answer holds a replica's GPUs longer than a short one. Why per replica and
hour: a replica kept warm through an hour for one team's sporadic traffic is that team's, and replicas of
different sizes (GPUs per replica) are charged at what each held.

Dividing is done in SQL (the attributed time per team and model, and the idle time per model: two queries), once
per hour: the tick rolls each hour up into TeamGpuHour rows ten minutes after it ends (`roll_up`), and a month's
showback sums those and divides only the hours not rolled up yet (four queries whatever the window).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connection
from django.db.models import Max, Min, Subquery, Sum, Value
from django.db.models.functions import Coalesce

from keys.models import GpuHour, ReplicaTokens, TeamGpuHour
from keys.usage import UPSERT_BATCH, hour_param, upsert_adding

GPU_COLUMNS = ["replica_id", "model", "hour", "gpu_seconds"]
ROLL_UP_AFTER = timedelta(minutes=10)
"""An hour is rolled up this long after it ends: its last GPU seconds and tokens have been stored by then."""
FIRST_HOUR = datetime(2000, 1, 1, tzinfo=UTC)
ROLL_UP_AT_MOST = timedelta(days=1)


def add_gpu_time(rows: list[tuple[int, str, int, float]]) -> None:
    """Add GPU seconds to `GpuHour`: each row is (replica id, model, hour start in Unix seconds, seconds)."""
    values = [(replica, model, hour_param(hour), seconds) for replica, model, hour, seconds in rows]
    for start in range(0, len(values), UPSERT_BATCH):
        batch = values[start : start + UPSERT_BATCH]
        upsert_adding(GpuHour, GPU_COLUMNS, ["replica_id", "hour"], ["gpu_seconds"], batch)


@dataclass(frozen=True)
class ShowbackRow:
    """One team's (None: keys of no team) GPU time on one model over the window, and the tokens it was shared by."""

    team: str | None
    model: str
    gpu_seconds: float
    tokens: int


@dataclass(frozen=True)
class Showback:
    """The GPU time spent in [start, end), attributed per team and model, and what stayed idle per model."""

    start: datetime
    end: datetime
    rows: list[ShowbackRow]
    idle: dict[str, float]
    """Model -> GPU seconds of its replicas' hours that served no tokens."""

    @property
    def attributed_seconds(self) -> float:
        return sum(row.gpu_seconds for row in self.rows)

    @property
    def total_seconds(self) -> float:
        """Every GPU second of the window: attributed and idle."""
        return self.attributed_seconds + sum(self.idle.values())

    def by_team(self) -> dict[str | None, float]:
        """Team name (None: no team) -> its GPU seconds over every model, largest first."""
        teams: dict[str | None, float] = defaultdict(float)
        for row in self.rows:
            teams[row.team] += row.gpu_seconds
        return dict(sorted(teams.items(), key=lambda item: -item[1]))


def showback(start: datetime, end: datetime, teams: Iterable[int] | None = None) -> Showback:
    """The showback of [start, end) (hour starts, UTC); with `teams` (ids), only their rows (and no idle time,
    which belongs to no team). The hours rolled up already are summed from TeamGpuHour; the rest (this hour and
    the last, usually) are divided from the replicas' hours."""
    wanted = None if teams is None else sorted(set(teams))
    rolled = rolled_until()
    split = min(max(start, rolled or start), end)
    rows: dict[tuple[str | None, str], list[float]] = defaultdict(lambda: [0.0, 0])
    idle: dict[str, float] = defaultdict(float)
    if split > start:
        summed = TeamGpuHour.objects.filter(hour__gte=start, hour__lt=split)
        if wanted is not None:
            summed = summed.filter(team_id__in=wanted, idle=False)
        totals = summed.values("team__name", "model", "idle").annotate(seconds=Sum("gpu_seconds"), n=Sum("tokens"))
        for row in totals.order_by():
            if row["idle"]:
                idle[row["model"]] += row["seconds"]
            else:
                _add(rows, row["team__name"], row["model"], row["seconds"], row["n"])
    if end > split:
        attributed, unused = _divide(split, end, wanted, per_hour=False)
        for _, _, name, model, seconds, tokens in attributed:
            _add(rows, name, model, seconds, tokens)
        for _, model, seconds in unused:
            idle[model] += seconds
    ordered = sorted(rows.items(), key=lambda item: (item[0][0] or "", item[0][1]))
    shown = [ShowbackRow(team, model, seconds, int(tokens)) for (team, model), (seconds, tokens) in ordered]
    return Showback(start=start, end=end, rows=shown, idle=dict(sorted(idle.items())))


def _add(rows: dict[tuple[str | None, str], list[float]], team: str | None, model: str, seconds: float, n: int) -> None:
    row = rows[(team, model)]
    row[0] += seconds
    row[1] += n


def rolled_until() -> datetime | None:
    """The end of the last hour rolled up (None: none yet). One query."""
    last = TeamGpuHour.objects.aggregate(last=Max("hour"))["last"]
    return None if last is None else last + timedelta(hours=1)


def roll_up(now: datetime) -> int:
    """Roll the hours that ended ROLL_UP_AFTER ago or more, and are not rolled up yet, into TeamGpuHour rows, a day
    of them at most (a fleet upgraded with a year of GPU time catches up a day a count, never stalling a tick);
    returns the rows written. One query when there is nothing to roll up (run by the tick beside the GPU time)."""
    upto = (now - ROLL_UP_AFTER).replace(minute=0, second=0, microsecond=0)
    last = TeamGpuHour.objects.order_by("-hour").values("hour")[:1]
    unrolled = GpuHour.objects.filter(hour__gt=Coalesce(Subquery(last), Value(FIRST_HOUR)), hour__lt=upto)
    start = unrolled.aggregate(first=Min("hour"))["first"]
    if start is None:
        return 0
    attributed, unused = _divide(start, min(upto, start + ROLL_UP_AT_MOST), None, per_hour=True)
    made = [TeamGpuHour(hour=_at(h), model=m, team_id=t, gpu_seconds=g, tokens=n) for h, t, _, m, g, n in attributed]
    made += [TeamGpuHour(hour=_at(h), model=m, idle=True, gpu_seconds=g) for h, m, g in unused]
    TeamGpuHour.objects.bulk_create(made, batch_size=UPSERT_BATCH)
    return len(made)


def _at(hour: Any) -> datetime:
    """An hour as the database gave it back in raw SQL (a datetime, or SQLite's text), as an aware datetime."""
    value = hour if isinstance(hour, datetime) else datetime.fromisoformat(str(hour))
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _divide(start: datetime, end: datetime, wanted: list[int] | None, per_hour: bool) -> tuple[list[Any], list[Any]]:
    """Divide the replicas' hours of [start, end) in SQL: rows of (hour, team id, team name, model, GPU seconds,
    tokens) and idle rows of (hour, model, GPU seconds); `hour` None unless `per_hour`. Two queries (one without
    idle time when `wanted` names teams)."""
    quote = connection.ops.quote_name
    team_model = ReplicaTokens._meta.get_field("team").related_model  # teams.Team, a layer above: by its field
    shares, hours, team = (quote(m._meta.db_table) for m in (ReplicaTokens, GpuHour, team_model))
    window = [hour_param(int(start.timestamp())), hour_param(int(end.timestamp()))]
    only = (
        "" if wanted is None else f" AND u.team_id IN ({', '.join(['%s'] * len(wanted))})" if wanted else " AND 0 = 1"
    )
    # PostgreSQL groups by no constant: without hours, NULL is selected and not grouped by.
    hour_of, group = ("u.hour", "u.hour, ") if per_hour else ("NULL", "")
    # Each key's tokens over its replica's whole hour, times that hour's GPU seconds: gpu_seconds comes first so
    # the division is a float's, not an integer's.
    attributed = f"""
        SELECT {hour_of}, u.team_id, t.name, g.model, SUM(g.gpu_seconds * u.tokens / w.total), SUM(u.tokens)
        FROM {shares} u
        JOIN {hours} g ON g.replica_id = u.replica_id AND g.hour = u.hour
        JOIN (SELECT replica_id, hour, SUM(tokens) AS total FROM {shares}
              WHERE hour >= %s AND hour < %s GROUP BY replica_id, hour) w
          ON w.replica_id = u.replica_id AND w.hour = u.hour
        LEFT JOIN {team} t ON t.id = u.team_id
        WHERE u.hour >= %s AND u.hour < %s AND w.total > 0{only}
        GROUP BY {group}u.team_id, t.name, g.model"""
    idle = f"""
        SELECT {hour_of.replace("u.", "g.")}, g.model, SUM(g.gpu_seconds) FROM {hours} g
        WHERE g.hour >= %s AND g.hour < %s AND NOT EXISTS (
            SELECT 1 FROM {shares} u WHERE u.replica_id = g.replica_id AND u.hour = g.hour AND u.tokens > 0)
        GROUP BY {group.replace("u.", "g.")}g.model"""
    with connection.cursor() as cursor:
        cursor.execute(attributed, [*window, *window, *(wanted or [])])
        rows = [(h, t, name, model, float(g), int(n)) for h, t, name, model, g, n in cursor.fetchall()]
        unused: list[Any] = []
        if wanted is None:
            cursor.execute(idle, window)
            unused = [(h, model, float(g)) for h, model, g in cursor.fetchall()]
    return rows, unused


def gpu_hours(seconds: float) -> str:
    """GPU seconds as operators read them: `1,234.5` GPU-hours."""
    return f"{seconds / 3600:,.1f}"


def month_bounds(month: str | None, now: datetime) -> tuple[datetime, datetime]:
    """[start, end) of `month` (YYYY-MM), or of `now`'s month when None, in UTC. ValueError names the form."""
    if month is None:
        start = now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    else:
        try:
            start = datetime.strptime(month, "%Y-%m").replace(tzinfo=UTC)
            if not 2000 <= start.year <= 2999:  # no fleet ran earlier; 9999-12 would have no end
                raise ValueError(month)
        except ValueError:
            raise ValueError(f"must be YYYY-MM from 2000-01 to 2999-12, as 2026-11: got {month[:40]!r}") from None
    return start, (start.replace(day=28) + timedelta(days=4)).replace(day=1)
