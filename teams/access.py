"""Who may see and change what: operators (Django staff) everything; a team's admins its keys, members and
budgets; every user their own keys, in the teams they belong to, and the budgets that apply to them. Every page and
endpoint that shows keys, teams, usage or budgets to someone who is not an operator asks here, so no role sees
beyond its own."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.db.models import OuterRef, Q, QuerySet, Subquery

from keys.models import ApiKey, Budget, TokenUsage
from teams.models import Membership, Team


def is_operator(user: Any) -> bool:
    """Operators run the fleet: they see and do everything, in a team or not."""
    return bool(user.is_active and user.is_staff)


def visible_teams(user: Any) -> QuerySet[Team]:
    """The teams the user belongs to (every team, for an operator)."""
    if is_operator(user):
        return Team.objects.all()
    return Team.objects.filter(memberships__user=user)


def administered_teams(user: Any) -> QuerySet[Team]:
    """The teams whose keys and members the user manages (every team, for an operator)."""
    if is_operator(user):
        return Team.objects.all()
    return Team.objects.filter(memberships__user=user, memberships__role=Membership.Role.ADMIN)


def visible_keys(user: Any) -> QuerySet[ApiKey]:
    """The keys the user may see and revoke: their own, and those of the teams they administer."""
    if is_operator(user):
        return ApiKey.objects.all()
    return ApiKey.objects.filter(Q(user=user) | Q(team__in=administered_teams(user).values("pk")))


def administered_members(user: Any) -> QuerySet[Any]:
    """The users in the teams the user administers (every user, for an operator)."""
    users = get_user_model().objects
    if is_operator(user):
        return users.all()
    memberships = Membership.objects.filter(team__in=administered_teams(user).values("pk"))
    return users.filter(pk__in=memberships.values("user_id"))


def visible_usage(user: Any) -> QuerySet[TokenUsage]:
    """The token usage of the keys the user may see (usage of a deleted key: operators only)."""
    if is_operator(user):
        return TokenUsage.objects.all()
    return TokenUsage.objects.filter(key__in=visible_keys(user).values("pk"))


def visible_budgets(user: Any) -> QuerySet[Budget]:
    """The budgets that apply to the user (their teams', their own within a team, their keys') and those of the
    teams they administer (the team's, its members', its keys')."""
    if is_operator(user):
        return Budget.objects.all()
    teams = visible_teams(user).values("pk")
    return Budget.objects.filter(
        Q(team__in=teams, user__isnull=True)
        | Q(team__in=teams, user=user)
        | Q(key__in=visible_keys(user).values("pk"))
        | Q(team__in=administered_teams(user).values("pk"))
    )


def budgets_applying_to(user: Any) -> QuerySet[Budget]:
    """The budgets a request of the user's own keys must fit: their teams' own, their member budget in each team,
    and their keys' (an operator's too: their own, not every budget)."""
    teams = Membership.objects.filter(user=user).values("team_id")
    return Budget.objects.filter(
        Q(team__in=teams, user__isnull=True) | Q(team__in=teams, user=user) | Q(key__user=user)
    )


def administered_budgets(user: Any) -> QuerySet[Budget]:
    """The budgets the user may change: those of the teams they administer, their members' and their keys'."""
    if is_operator(user):
        return Budget.objects.all()
    teams = administered_teams(user).values("pk")
    return Budget.objects.filter(Q(team__in=teams) | Q(key__team__in=teams))


def with_roles(teams: QuerySet[Team], user: Any) -> QuerySet[Team]:
    """`teams`, each annotated with the user's role in it (`role`: "admin", "member", None), in the same query."""
    roles = Membership.objects.filter(team=OuterRef("pk"), user=user).values("role")[:1]
    return teams.annotate(role=Subquery(roles))
