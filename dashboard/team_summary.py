"""What each team spends and where its budgets stand: the teams part the operators' surfaces share
(`ctl_status --teams` and the control plane's metrics both read `team_summary()`, so they cannot disagree).

Seven queries whatever the number of teams, members, keys or hourly rows — the teams with their members and
usable keys counted, their spend this UTC day and month summed in SQL over TokenUsage's (team, hour) index, every
budget that bears on a team (its own, its members', its keys'), and this month's showback (`keys.showback`, four)
— then one hub round trip for those budgets' counters (`keys.budget_use`). Spend is what the routers charged, as the hourly rows hold it; a budget's use is its
counter: spent and still reserved, in the budget's own window and time zone.

A budget's use is unknown (None, `-` in text) when no hub is given — `ctl_status` in embedded mode, whose counters
live in the memory of the `llmgw up` process — or when the hub cannot be read; the spend is shown all the same.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

from django.db.models import Count, IntegerField, OuterRef, Q, Subquery, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone
from redis import RedisError

from hub.contracts import BudgetReader
from keys.budget_use import BudgetUse, NoCounters, current_use, money
from keys.models import ApiKey, Budget, TokenUsage
from keys.showback import month_bounds, showback
from teams.models import Membership, Team

log = logging.getLogger(__name__)

WINDOW_ORDER = [choice.value for choice in Budget.Window]
"""A team's budgets are listed in this order: day, week, month, none."""


@dataclass(frozen=True)
class TeamBudgetStatus:
    """One of a team's own budgets (no member, no key) in its current window: what its counter holds against its
    amount, and when the window resets (an instant, shown in the budget's time zone)."""

    window: str
    timezone: str
    amount_units: int
    used_units: int | None
    """Spent and still reserved in the window (10⁻¹² units); None while the hub's counters are unknown."""
    resets_at: str | None
    """The window's end (ISO 8601, UTC); None for a budget with no window."""

    @property
    def used_ratio(self) -> float | None:
        """What it holds over its amount (1 or more: exhausted); None while unknown. A budget of 0 allows nothing,
        so it is wholly used (1) while nothing is spent against it."""
        if self.used_units is None:
            return None
        if not self.amount_units:
            return 1.0 if not self.used_units else float("inf")
        return self.used_units / self.amount_units

    def text(self) -> str:
        """`7.50 / 10.00 per day, resets 2026-12-05 00:00 CET` (`-` for a use unknown)."""
        used = "-" if self.used_units is None else money(self.used_units)
        head = f"{used} / {money(self.amount_units)}"
        if self.resets_at is None:
            return f"{head} for all time"
        local = datetime.fromisoformat(self.resets_at).astimezone(ZoneInfo(self.timezone))
        return f"{head} per {self.window}, resets {local:%Y-%m-%d %H:%M %Z}"


@dataclass(frozen=True)
class TeamStatus:
    """A team: its members, its usable keys, what it spent today and this month (UTC), its own budgets, and how
    many of all the budgets bearing on it hold their whole amount."""

    name: str
    members: int
    active_keys: int
    """Keys of the team neither revoked nor expired."""
    spend_today_units: int
    spend_month_units: int
    gpu_seconds_month: float
    """Its showback this UTC month: the GPU time of the replicas it used, by its share of their tokens."""
    budgets: list[TeamBudgetStatus]
    budgets_exhausted: int | None
    """Its own budgets, its members' and its keys' whose counters hold their whole amount; None while unknown."""


@dataclass(frozen=True)
class TeamSummary:
    """Every team, the most spent this month first (`ctl_status --teams`, the `llmgw_team_*` metrics)."""

    generated_at: str
    day_start: str
    """Spend today counts from this UTC midnight; this month from `month_start`."""
    month_start: str
    budgets_known: bool
    """Whether the budgets' counters were read (False: no hub, or it could not be read)."""
    teams: list[TeamStatus]
    gpu_seconds_month_no_team: float = 0.0
    """This month's GPU time used by keys of no team."""
    gpu_seconds_month_idle: float = 0.0
    """This month's GPU time of replicas' hours that served no tokens: kept ready, used by nobody."""

    def as_json(self) -> dict[str, Any]:
        """The JSON form (`ctl_status --teams --json`): every field by name, in order."""
        return asdict(self)


def _counted(queryset: Any) -> Coalesce:
    """The rows of `queryset` (filtered on OuterRef("pk")) counted per team in a subquery: no join that multiplies
    a team's members by its keys."""
    counts = queryset.order_by().values("team").annotate(n=Count("pk")).values("n")
    return Coalesce(Subquery(counts, output_field=IntegerField()), 0)


def _teams(now: datetime) -> list[tuple[int, str, int, int]]:
    """(id, name, members, usable keys) of every team. One query."""
    members = Membership.objects.filter(team=OuterRef("pk"))
    usable = Q(expires_at__isnull=True) | Q(expires_at__gt=now)
    keys = ApiKey.objects.active().filter(usable, team=OuterRef("pk"))
    rows = Team.objects.annotate(members=_counted(members), keys=_counted(keys)).order_by("name")
    return list(rows.values_list("pk", "name", "members", "keys"))


def _spend(team_ids: list[int], day_start: datetime, month_start: datetime) -> dict[int, tuple[int, int]]:
    """Team id -> (spend today, spend this month) in units. One query, summed in SQL; `team IN (…) AND hour >= …`
    reads the (team, hour) index one range per team, however long the history."""
    rows = (
        TokenUsage.objects.filter(team_id__in=team_ids, hour__gte=month_start)
        .values("team_id")
        .annotate(day=Sum("spend_units", filter=Q(hour__gte=day_start)), month=Sum("spend_units"))
        .order_by()
        .values_list("team_id", "day", "month")
    )
    return {team_id: (day or 0, month or 0) for team_id, day, month in rows}


def _budgets() -> list[Budget]:
    """Every budget bearing on a team: its own, its members' and its keys' (with the key, to tell its team). One
    query."""
    bearing = Q(team__isnull=False) | Q(key__team__isnull=False)
    return list(Budget.objects.filter(bearing).select_related("key").order_by("id"))


def _use(budgets: list[Budget], hub: BudgetReader | None, now: datetime) -> tuple[list[BudgetUse], bool]:
    """The budgets in their current windows, and whether their counters were read (one round trip): not without a
    hub, nor when it does not answer (then every use reads 0 and must be shown unknown)."""
    if hub is not None:
        try:
            return current_use(budgets, hub, now), True
        except RedisError as exc:
            # Operators still need the spend: the budgets' use is shown unknown, never as zero.
            log.warning("budget counters unavailable (%s): budgets' use is unknown", exc)
    return current_use(budgets, NoCounters(), now), False


def _own(use: BudgetUse, known: bool) -> TeamBudgetStatus:
    budget, end = use.budget, use.end
    used = use.used if known else None
    return TeamBudgetStatus(budget.window, budget.timezone, use.limit, used, end.isoformat() if end else None)


def team_summary(hub: BudgetReader | None, now: datetime | None = None) -> TeamSummary:
    """Every team's members, usable keys, spend and budgets at `now` (default: now); see the module docstring."""
    now = now or timezone.now()
    day_start = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    month_start = day_start.replace(day=1)
    teams = _teams(now)
    spend = _spend([team_id for team_id, *_ in teams], day_start, month_start)
    uses, known = _use(_budgets(), hub, now)
    month = showback(*month_bounds(None, now))
    gpu = month.by_team()
    own: dict[int, list[TeamBudgetStatus]] = defaultdict(list)
    exhausted: dict[int, int] = defaultdict(int)
    for use in uses:
        budget = use.budget
        if budget.team_id is not None and budget.user_id is None:
            own[budget.team_id].append(_own(use, known))
        owner = budget.team_id if budget.key is None else budget.key.team_id
        if owner is not None and use.reached(100):
            exhausted[owner] += 1
    statuses = [
        TeamStatus(
            name,
            members,
            keys,
            *spend.get(team_id, (0, 0)),
            gpu.get(name, 0.0),
            sorted(own[team_id], key=lambda b: WINDOW_ORDER.index(b.window)),
            exhausted[team_id] if known else None,
        )  # fmt: skip
        for team_id, name, members, keys in teams
    ]
    statuses.sort(key=lambda team: -team.spend_month_units)  # stable: by name within a spend
    return TeamSummary(
        now.isoformat(),
        day_start.isoformat(),
        month_start.isoformat(),
        known,
        statuses,
        gpu.get(None, 0.0),
        sum(month.idle.values()),
    )
