"""What the self-service pages (/me/) show and change, for people who are not operators: their teams, keys, usage
and budgets, and for a team's admins the team's members, keys, budgets and usage.

Each page is a fixed number of queries whatever the number of keys, members, budgets or hourly rows, and one hub
round trip for the budgets' counters (keys.budget_use). Each change is one transaction; the routers hear of it
after commit (keys.changes), so a revoked key is refused everywhere within a second. Who may see what is decided by
the views through teams.access; these functions act on what they are given.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Q
from redis import RedisError

from hub.contracts import BudgetReader
from keys.budget_use import BudgetUse, NoCounters, current_use, money
from keys.changes import set_keys_active
from keys.models import ApiKey, Budget, TokenUsage
from keys.showback import gpu_hours, month_bounds, showback
from teams.access import budgets_applying_to, is_operator, visible_teams, with_roles
from teams.models import Membership, Team
from teams.usage_report import UsageReport, usage_report

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TeamRole:
    """A team as its list on /me/ shows it: the user's role in it (None: an operator outside it), and whether they
    manage it (its admins and operators)."""

    pk: int
    name: str
    role: str | None
    manages: bool


@dataclass(frozen=True)
class KeyRow:
    """A key with its state in words: active, revoked, or expired (refused from its expiry on)."""

    key: ApiKey
    state: str

    @property
    def revocable(self) -> bool:
        """Whether a Revoke button makes sense: the key is not revoked yet."""
        return self.key.active


@dataclass(frozen=True)
class BudgetLine:
    """A budget in its current window: whose it is, its amount, what it holds now (spent and reserved; `-` when the
    hub's counters cannot be read), its window and when that resets, in the budget's own time zone."""

    scope: str
    amount: str
    used: str
    window: str
    resets: str
    exhausted: bool


@dataclass(frozen=True)
class MyPage:
    """/me/: the user's teams, their own keys, the usage of those keys, and the budgets that apply to them."""

    teams: list[TeamRole]
    keys: list[KeyRow]
    usage: UsageReport
    budgets: list[BudgetLine]


@dataclass(frozen=True)
class TeamPage:
    """/me/teams/<id>/: a team's members, keys, budgets (its own, its members', its keys') and usage."""

    team: Team
    members: list[Membership]
    keys: list[KeyRow]
    usage: UsageReport
    budgets: list[BudgetLine]
    gpu_hours: list[tuple[str, str, int]]
    """This UTC month's showback (keys.showback), per model: (model, GPU-hours as text, tokens shared by)."""


def my_page(user: Any, hub: BudgetReader, now: datetime) -> MyPage:
    """What /me/ shows `user` at `now`: four queries and one hub round trip."""
    operator = is_operator(user)
    roles = [(team, team.role) for team in with_roles(visible_teams(user), user)]  # type: ignore[attr-defined]
    teams = [TeamRole(team.pk, team.name, role, operator or role == Membership.Role.ADMIN) for team, role in roles]
    keys = ApiKey.objects.filter(user=user).select_related("team").order_by("-created_at", "-id")
    budgets = budgets_applying_to(user).select_related("key", "team", "user").order_by("id")
    usage = usage_report(TokenUsage.objects.filter(key__user=user), now)
    return MyPage(teams, _key_rows(keys, now), usage, budget_lines(list(budgets), hub, now))


def team_page(team: Team, hub: BudgetReader, now: datetime) -> TeamPage:
    """What /me/teams/<id>/ shows a team's admin at `now`: six or seven queries (the showback's: keys.showback) and
    one hub round trip."""
    members = Membership.objects.filter(team=team).select_related("user").order_by("user__username")
    keys = ApiKey.objects.filter(team=team).select_related("user").order_by("-created_at", "-id")
    budgets = Budget.objects.filter(Q(team=team) | Q(key__team=team)).select_related("key", "team", "user")
    usage = usage_report(TokenUsage.objects.filter(team=team), now)
    month = showback(*month_bounds(None, now), teams=[team.pk])
    gpu = [(row.model, gpu_hours(row.gpu_seconds), row.tokens) for row in month.rows]
    lines = budget_lines(list(budgets.order_by("id")), hub, now)
    return TeamPage(team, list(members), _key_rows(keys, now), usage, lines, gpu)


def _key_rows(keys: Any, now: datetime) -> list[KeyRow]:
    rows = []
    for key in keys:
        expired = key.expires_at is not None and key.expires_at <= now
        rows.append(KeyRow(key, "revoked" if not key.active else "expired" if expired else "active"))
    return rows


def budget_lines(budgets: Sequence[Budget], hub: BudgetReader, now: datetime) -> list[BudgetLine]:
    """Each budget (with its key, team and user loaded) in its window at `now`, in the order given. A hub that does
    not answer leaves the use unknown (`-`), never zero: the page still shows the rest."""
    try:
        uses, known = current_use(budgets, hub, now), True
    except RedisError as exc:
        log.warning("budget counters unavailable (%s): budgets' use is shown unknown", exc)
        uses, known = current_use(budgets, NoCounters(), now), False
    return [_line(use, known) for use in uses]


def _line(use: BudgetUse, known: bool) -> BudgetLine:
    budget = use.budget
    if use.end is None:
        resets = "never (for all time)"
    else:
        resets = f"{use.end.astimezone(ZoneInfo(budget.timezone)):%Y-%m-%d %H:%M %Z}"
    return BudgetLine(
        budget.scope_text(),
        money(use.limit),
        money(use.used) if known else "-",
        Budget.Window(budget.window).label,
        resets,
        known and use.reached(100),
    )


def issue_key(holder: Any, name: str, team: Team | None, models: list[str]) -> tuple[ApiKey, str]:
    """Make a key held by `holder` in `team` (None: an operator's key of no team), limited to `models` (empty: all
    the team's), and return it with its plaintext, which is never stored. Judged by ApiKey.clean in the same
    transaction (a key of a team is its member's, and names none of the team's models beyond it): a ValidationError
    names the field."""
    with transaction.atomic():
        ApiKey(name=name, team=team, user=holder, allowed_models=models).clean()
        return ApiKey.issue(name, team=team, user=holder, allowed_models=models)


def revoke_key(key: ApiKey) -> None:
    """Revoke the key; every router refuses it within a second (keys.changes.set_keys_active)."""
    set_keys_active(ApiKey.objects.filter(pk=key.pk), False)


def add_member(team: Team, user: Any, role: str) -> Membership:
    """Add `user` to `team` with `role`; a ValidationError on `user` if they are in it already (the database's
    constraint judges, so two admins adding the same person at once make one membership)."""
    try:
        with transaction.atomic():
            return Membership.objects.create(team=team, user=user, role=role)
    except IntegrityError:
        raise ValidationError({"user": f"{user} is already in the team “{team.name}”."}) from None


def remove_member(membership: Membership) -> None:
    """Take the member out of the team: their keys of the team are revoked (teams.changes.member_left). The team's
    last admin stays (ValidationError): without one, only an operator could manage the team again."""
    with transaction.atomic():
        # Its admins' rows locked in key order: two admins removing each other at once leave one of them.
        admins = list(
            Membership.objects.select_for_update()
            .filter(team_id=membership.team_id, role=Membership.Role.ADMIN)
            .order_by("pk")
            .values_list("pk", flat=True)
        )
        if admins == [membership.pk]:
            message = (
                f"{membership.user} is the team's last admin: the team needs another first "
                "(add one here, or ask an operator to make a member admin)."
            )
            raise ValidationError({"user": message})
        membership.delete()
