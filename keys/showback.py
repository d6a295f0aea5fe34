"""Showback: each team's share of the GPU time the fleet spent, attributed replica by replica and hour by hour
by the team's share of the tokens that replica served in that hour.

The whole to divide is `GpuHour` (a replica's awake GPUs times the seconds it held them, reconciler.demand.gpu_time);
the shares are `ReplicaTokens` (tokens per replica, key and hour, as the routers counted them, with the key's team
then). A replica's hour with no tokens is *idle*: GPU time spent keeping a model ready that nobody used in that
hour, reported per model rather than charged to a team. Keys of no team are reported together as team None.

Why tokens and not requests: a long answer holds a replica's GPUs longer than a short one. Why per replica and
hour: a replica kept warm through an hour for one team's sporadic traffic is that team's, and replicas of
different sizes (GPUs per replica) are charged at what each held.

Two queries whatever the window: the attributed time per team and model (the whole division in SQL), and the idle
time per model.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import connection

from keys.models import GpuHour, ReplicaTokens
from keys.usage import UPSERT_BATCH, hour_param, upsert_adding

GPU_COLUMNS = ["replica_id", "model", "hour", "gpu_seconds"]


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
    which belongs to no team)."""
    quote = connection.ops.quote_name
    team_model = ReplicaTokens._meta.get_field("team").related_model  # teams.Team, a layer above: by its field
    shares, hours, team = (quote(m._meta.db_table) for m in (ReplicaTokens, GpuHour, team_model))
    window = [hour_param(int(start.timestamp())), hour_param(int(end.timestamp()))]
    wanted = None if teams is None else sorted(set(teams))
    only = (
        "" if wanted is None else f" AND u.team_id IN ({', '.join(['%s'] * len(wanted))})" if wanted else " AND 0 = 1"
    )
    # Each key's tokens over its replica's whole hour, times that hour's GPU seconds: gpu_seconds comes first so
    # the division is a float's, not an integer's.
    attributed = f"""
        SELECT t.name, g.model, SUM(g.gpu_seconds * u.tokens / w.total), SUM(u.tokens)
        FROM {shares} u
        JOIN {hours} g ON g.replica_id = u.replica_id AND g.hour = u.hour
        JOIN (SELECT replica_id, hour, SUM(tokens) AS total FROM {shares}
              WHERE hour >= %s AND hour < %s GROUP BY replica_id, hour) w
          ON w.replica_id = u.replica_id AND w.hour = u.hour
        LEFT JOIN {team} t ON t.id = u.team_id
        WHERE u.hour >= %s AND u.hour < %s AND w.total > 0{only}
        GROUP BY u.team_id, t.name, g.model
        ORDER BY t.name, g.model"""
    idle = f"""
        SELECT g.model, SUM(g.gpu_seconds) FROM {hours} g
        WHERE g.hour >= %s AND g.hour < %s AND NOT EXISTS (
            SELECT 1 FROM {shares} u WHERE u.replica_id = g.replica_id AND u.hour = g.hour AND u.tokens > 0)
        GROUP BY g.model ORDER BY g.model"""
    with connection.cursor() as cursor:
        cursor.execute(attributed, [*window, *window, *(wanted or [])])
        rows = [ShowbackRow(name, model, float(seconds), int(tokens)) for name, model, seconds, tokens in cursor]
        idle_seconds: dict[str, float] = {}
        if wanted is None:
            cursor.execute(idle, window)
            idle_seconds = {model: float(seconds) for model, seconds in cursor}
    return Showback(start=start, end=end, rows=rows, idle=idle_seconds)


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
