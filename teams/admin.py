"""Teams in the admin: a team's name, the models its keys may use at most, and its members with their roles."""

from django import forms
from django.contrib import admin

from keys.admin import CommaListField, known_models, typed
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
        fields = ["name", "allowed_models"]

    def clean_allowed_models(self) -> list[str]:
        return known_models(self.cleaned_data["allowed_models"])


class MembershipInline(admin.TabularInline[Membership, Team]):
    """The team's members and their roles, edited on the team's page."""

    model = Membership
    extra = 1
    raw_id_fields = ["user"]  # an organisation has thousands of users: not one select of them all


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin[Team]):
    """Teams with their members; a team holding keys cannot be deleted (revoke or move them first)."""

    form = TeamForm
    inlines = [MembershipInline]
    list_display = ["name", "models_shown", "created_at"]
    search_fields = ["name"]

    @typed(admin.display(description="models"))
    def models_shown(self, obj: Team) -> str:
        return ", ".join(obj.allowed_models) or "all"
