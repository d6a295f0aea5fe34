"""Teams in the admin: a team's name, the models its keys may use at most, its members with their roles, and the
budgets of the team and of its members."""

from typing import Any

from django import forms
from django.contrib import admin
from django.contrib.admin.options import InlineModelAdmin
from django.http import HttpRequest

from keys.admin import HTTPS_URLS, CommaListField, known_models, typed
from keys.models import Budget
from teams.models import Membership, Team


class TeamForm(forms.ModelForm[Team]):
    """A team's fields, its models a comma list checked against the catalog."""

    allowed_models = CommaListField(
        required=False,
        label="Allowed models",
        help_text="Models or aliases its keys may use at most, comma-separated; empty = all.",
    )

    class Meta:
        model = Team
        fields = ["name", "allowed_models", "weight", "priority_class"]

    def clean_allowed_models(self) -> list[str]:
        return known_models(self.cleaned_data["allowed_models"])


class MembershipInline(admin.TabularInline[Membership, Team]):
    """The team's members and their roles, edited on the team's page."""

    model = Membership
    extra = 1
    raw_id_fields = ["user"]  # an organisation has thousands of users: not one select of them all


class BudgetInline(admin.TabularInline[Budget, Team]):
    """The team's budget (no user) and its members' within it (a key's budget is on the budgets page)."""

    model = Budget
    extra = 0
    fields = ["user", "amount", "window", "timezone", "soft_limit_percent", "alert_url"]
    raw_id_fields = ["user"]
    formfield_overrides = HTTPS_URLS


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin[Team]):
    """Teams with their members and budgets; a team holding keys cannot be deleted (revoke or move them first)."""

    form = TeamForm
    inlines = [MembershipInline, BudgetInline]
    list_display = ["name", "models_shown", "created_at"]
    search_fields = ["name"]

    @typed(admin.display(description="models"))
    def models_shown(self, obj: Team) -> str:
        return ", ".join(obj.allowed_models) or "all"

    def get_inlines(self, request: HttpRequest, obj: Team | None) -> list[type[InlineModelAdmin[Any, Any]]]:
        # A budget is checked against its team and its members (Budget.clean): they are saved first.
        return [MembershipInline, BudgetInline] if obj is not None else [MembershipInline]
