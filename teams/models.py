"""Teams and their members.

A team is a group of people sharing the fleet under one set of models
(`allowed_models`): every key of the team is held to it, whatever the key
names itself (keys narrow the team's scope, never widen it). A member is a
Django user with a role in the team: an admin manages the team's keys and
members, a member their own keys. Operators (Django staff) see and do
everything, in a team or not.
"""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from hub.priority import MAX_TEAM_WEIGHT, PriorityClass


class Team(models.Model):
    """A group of people sharing the fleet, and the models its keys may use."""

    name = models.CharField(max_length=100, unique=True)
    allowed_models = models.JSONField(
        default=list,
        blank=True,
        help_text='Models (names or aliases) every key of the team may use at most, e.g. ["llama3"]; empty = all. '
        "A key's own scope narrows it, never widens it.",
    )
    weight = models.PositiveSmallIntegerField(
        default=1,
        db_default=1,  # rows written by code that predates it (a rolling upgrade) keep the default
        validators=[MinValueValidator(1), MaxValueValidator(MAX_TEAM_WEIGHT)],
        help_text="Its share of a full model against other teams': a team of weight 3 is served three times the "
        "tokens of a team of weight 1 while both wait.",
    )
    priority_class = models.CharField(
        "priority class",
        max_length=12,
        choices=PriorityClass.choices,
        default=PriorityClass.STANDARD,
        db_default=PriorityClass.STANDARD.value,
        help_text="Which of a full model's waiting requests leave first: interactive, then standard, then batch "
        "(served from spare capacity only). A key may set its own.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def has_member(self, user_id: int) -> bool:
        """Whether the user is a member of the team (in any role)."""
        return self.memberships.filter(user_id=user_id).exists()


class Membership(models.Model):
    """A user's place in a team: an admin (manages the team's keys and members) or a member (their own keys)."""

    class Role(models.TextChoices):
        ADMIN = "admin", "admin"
        MEMBER = "member", "member"

    team = models.ForeignKey(Team, related_name="memberships", on_delete=models.CASCADE)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, related_name="memberships", on_delete=models.CASCADE)
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)

    class Meta:
        ordering = ["team", "user"]
        constraints = [models.UniqueConstraint(fields=["team", "user"], name="membership_once_per_team")]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.role})"
