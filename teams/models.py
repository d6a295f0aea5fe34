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
from django.db import models


class Team(models.Model):
    """A group of people sharing the fleet, and the models its keys may use."""

    name = models.CharField(max_length=100, unique=True)
    allowed_models = models.JSONField(
        default=list,
        blank=True,
        help_text='Models (names or aliases) every key of the team may use at most, e.g. ["llama3"]; empty = all. '
        "A key's own scope narrows it, never widens it.",
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
