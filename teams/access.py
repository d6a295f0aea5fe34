"""Who may see and change what: operators (Django staff) everything; a team's admins its keys and members; every
user their own keys, in the teams they belong to. Every page and endpoint that shows keys, teams or usage to
someone who is not an operator asks here, so no role sees beyond its own."""

from __future__ import annotations

from typing import Any

from django.db.models import OuterRef, Q, QuerySet, Subquery

from keys.models import ApiKey, TokenUsage
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


def visible_usage(user: Any) -> QuerySet[TokenUsage]:
    """The token usage of the keys the user may see (usage of a deleted key: operators only)."""
    if is_operator(user):
        return TokenUsage.objects.all()
    return TokenUsage.objects.filter(key__in=visible_keys(user).values("pk"))


def with_roles(teams: QuerySet[Team], user: Any) -> QuerySet[Team]:
    """`teams`, each annotated with the user's role in it (`role`: "admin", "member", None), in the same query."""
    roles = Membership.objects.filter(team=OuterRef("pk"), user=user).values("role")[:1]
    return teams.annotate(role=Subquery(roles))
