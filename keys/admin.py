"""API keys in the admin: keys are created from a name (and scopes, expiry, limits), shown once, revoked and restored;
the budgets of keys, members and teams.

Only a key's hash is stored. Every change of a key or a budget reaches every
router within a second (keys.changes).
"""

from collections.abc import Callable
from typing import Any, TypeVar

from django import forms
from django.contrib import admin, messages
from django.db import models
from django.db.models import QuerySet
from django.http import HttpRequest

from keys.changes import set_keys_active
from keys.models import ApiKey, Budget, TokenUsage
from keys.scopes import parse_names, unknown_models, unknown_models_message

PUSHED = "refused by every router within a second"
# An alert URL typed without its scheme is https: what a webhook wants, and Django 6's default.
HTTPS_URLS: dict[type[models.Field[Any, Any]], dict[str, Any]] = {models.URLField: {"assume_scheme": "https"}}

Method = TypeVar("Method", bound=Callable[..., Any])


def typed(decorator: Any) -> Callable[[Method], Method]:
    """One of Django's admin decorators, which return the method they are given with attributes set, as such
    (Django ships no types)."""
    kept: Callable[[Method], Method] = decorator
    return kept


class CommaListField(forms.CharField):
    """A JSON list of names edited as `a, b, c`."""

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, list):
            return ", ".join(value)
        return value

    # A list where Django's CharField gives a string: the form's clean step and the model field want the list.
    def to_python(self, value: Any) -> list[str]:  # type: ignore[override]
        return parse_names(super().to_python(value) or "")


class ApiKeyForm(forms.ModelForm[ApiKey]):
    """The key's editable fields, with scopes as comma lists checked against the catalog."""

    allowed_models = CommaListField(
        required=False,
        label="Allowed models",
        help_text="Models or aliases it may use, comma-separated, e.g. “llama3, qwen”; empty = all.",
    )
    allowed_pools = CommaListField(
        required=False,
        label="Allowed pools",
        help_text="Pools whose replicas may serve it, comma-separated; empty = any.",
    )
    rpm = forms.IntegerField(required=False, min_value=1, label="Requests per minute", help_text="Empty = no limit.")
    tpm = forms.IntegerField(required=False, min_value=1, label="Tokens per minute", help_text="Empty = no limit.")

    class Meta:
        model = ApiKey
        fields = [
            "name",
            "active",
            "user",
            "team",
            "allowed_models",
            "allowed_pools",
            "expires_at",
            "rpm",
            "tpm",
            "priority_class",
        ]

    def clean_allowed_models(self) -> list[str]:
        return known_models(self.cleaned_data["allowed_models"])


def known_models(names: list[str]) -> list[str]:
    """`names`, if the catalog knows each; else a form error naming those it does not."""
    unknown = unknown_models(names)
    if unknown:
        message = unknown_models_message(unknown)
        raise forms.ValidationError(f"{message[0].upper()}{message[1:]}.")
    return names


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin[ApiKey]):
    """API keys: scopes, expiry and limits editable; last use read-only; revoke and restore in bulk."""

    form = ApiKeyForm
    list_display = [
        "name",
        "prefix",
        "active",
        "team",
        "user",
        "models_shown",
        "expires_at",
        "rpm",
        "tpm",
        "last_used_at",
        "created_at",
    ]
    list_filter = ["active", "team"]
    list_select_related = ["team", "user"]
    search_fields = ["name", "prefix"]
    actions = ["revoke", "restore"]
    SCOPE_FIELDS = ["user", "team", "allowed_models", "allowed_pools", "expires_at", "rpm", "tpm"]

    @typed(admin.display(description="models"))
    def models_shown(self, obj: ApiKey) -> str:
        return ", ".join(obj.allowed_models) or "all"

    def get_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> tuple[str, ...]:
        if obj is None:
            return ("name", *self.SCOPE_FIELDS)
        return ("name", "prefix", "active", *self.SCOPE_FIELDS, "last_used_at", "created_at")

    def get_readonly_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:
        return [] if obj is None else ["prefix", "last_used_at", "created_at"]

    def save_model(self, request: HttpRequest, obj: ApiKey, form: ApiKeyForm, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        data = form.cleaned_data
        issued, plaintext = ApiKey.issue(data["name"], **{field: data[field] for field in self.SCOPE_FIELDS})
        # The admin goes on to log and redirect with `obj`, so it becomes the issued row.
        for field in ApiKey._meta.concrete_fields:
            setattr(obj, field.attname, getattr(issued, field.attname))
        obj._state.adding = False
        self.message_user(
            request,
            f"API key for “{issued.name}”: {plaintext} — copy it now; it is stored hashed and will not be shown again.",
            messages.WARNING,
        )

    @typed(admin.action(description="Revoke the selected keys", permissions=["change"]))
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        count = set_keys_active(queryset, False)
        self.message_user(request, f"Revoked {count} key(s): {PUSHED}.", messages.SUCCESS)

    @typed(admin.action(description="Restore (unrevoke) the selected keys", permissions=["change"]))
    def restore(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        count = set_keys_active(queryset, True)
        self.message_user(
            request, f"Restored {count} key(s): accepted by every router within a second.", messages.SUCCESS
        )


@admin.register(TokenUsage)
class TokenUsageAdmin(admin.ModelAdmin[TokenUsage]):
    """Tokens per key, model and hour, as the control plane stored them from the routers' counts: read-only."""

    list_display = ["hour", "key_name", "model", "requests", "prompt_tokens", "completion_tokens", "spend", "team"]
    list_filter = ["key_name", "model", "team"]
    list_select_related = ["team"]
    search_fields = ["key_name", "model"]
    date_hierarchy = "hour"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: TokenUsage | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: TokenUsage | None = None) -> bool:
        return False


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin[Budget]):
    """Budgets of keys, of members within a team and of teams (a team's and its members' are on its page too);
    the form's errors are Budget.clean's, and every change reaches the routers within a second."""

    list_display = ["scope", "amount", "window", "timezone", "soft_limit_percent"]
    list_filter = ["window"]
    list_select_related = ["key", "team", "user"]
    search_fields = ["team__name", "user__username", "key__name"]
    fields = ["key", "team", "user", "amount", "window", "timezone", "soft_limit_percent", "alert_url"]
    autocomplete_fields = ["key", "team"]
    raw_id_fields = ["user"]  # as on a team's members: an organisation has thousands of users
    formfield_overrides = HTTPS_URLS

    @typed(admin.display(description="budget of"))
    def scope(self, obj: Budget) -> str:
        return obj.scope_text()
