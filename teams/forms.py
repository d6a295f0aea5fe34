"""The self-service pages' forms: a new key, a new member. Each error is shown next to the field it is about, in a
sentence naming the problem; the rules about a key or a membership are judged where they live (ApiKey.clean, the
membership's constraint) and their errors are put on the form's fields here."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError

from keys.admin import CommaListField, known_models
from keys.models import ApiKey
from teams.access import is_operator
from teams.models import Membership, Team


def put_errors(form: forms.Form, error: ValidationError, fields: dict[str, str]) -> None:
    """Add a model's ValidationError to `form`, each message on the form field `fields` maps its model field to
    (on the form as a whole when it maps to none)."""
    if not hasattr(error, "error_dict"):
        form.add_error(None, error)
        return
    for name, errors in error.error_dict.items():
        for each in errors:
            form.add_error(fields.get(name), each)


class NewKeyForm(forms.Form):
    """A key for oneself: its name, one of one's teams (none: an operator's key of no team) and, if it should use
    fewer models than its team, which."""

    name = forms.CharField(max_length=ApiKey._meta.get_field("name").max_length, help_text="To recognise it later.")
    team = forms.ModelChoiceField(
        queryset=Team.objects.none(),
        error_messages={
            "required": "Choose one of your teams: a key belongs to one.",
            "invalid_choice": "Choose one of your teams: you are not a member of that one.",
        },
    )
    models = CommaListField(
        required=False,
        label="Models",
        help_text="Models or aliases it may use, comma-separated, e.g. “llama3, qwen”; empty = all its team's.",
    )
    # Where a model's error goes on this form: ApiKey.clean speaks of the key's fields.
    FIELDS = {"name": "name", "team": "team", "user": "team", "allowed_models": "models"}

    def __init__(self, user: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields["team"]
        assert isinstance(field, forms.ModelChoiceField)
        field.queryset = Team.objects.filter(memberships__user=user).order_by("name")
        if is_operator(user):
            field.required = False
            field.empty_label = "no team (an operator's key)"
        else:
            field.empty_label = "choose one of your teams"

    def clean_models(self) -> list[str]:
        names: list[str] = self.cleaned_data["models"]
        return known_models(names)

    def add_key_error(self, error: ValidationError) -> None:
        """Show ApiKey.clean's refusal next to the field it is about."""
        put_errors(self, error, self.FIELDS)


class AddMemberForm(forms.Form):
    """Someone to add to a team, by username, with a role."""

    username = forms.CharField(max_length=150, help_text="Their login name; they need an account already.")
    role = forms.ChoiceField(choices=Membership.Role.choices, initial=Membership.Role.MEMBER)
    FIELDS = {"user": "username", "role": "role", "team": "username"}

    def clean_username(self) -> Any:
        """The user named, or an error naming the name no one has."""
        name = self.cleaned_data["username"].strip()
        user = get_user_model().objects.filter(username=name).first()
        if user is None:
            raise ValidationError(f"No user is called “{name}”: check the spelling (operators create accounts).")
        return user

    def add_member_error(self, error: ValidationError) -> None:
        """Show a refusal of the membership next to the field it is about."""
        put_errors(self, error, self.FIELDS)
