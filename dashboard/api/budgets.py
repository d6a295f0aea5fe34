"""Budgets over REST, for everyone signed in: operators see and change every budget; a team's admins their team's
(the team's own, its members', its keys'); a member sees the budgets that apply to them and changes none.

What each role sees comes from teams.access; a budget someone may not see is a 404 to them, as a key is. Writes go
through `writes.save_budget`, on Budget.clean, and reach the routers within a second (keys.changes)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any, cast

from django.contrib.auth import get_user_model
from django.core.validators import MinValueValidator
from django.db import models as db
from drf_spectacular.utils import extend_schema, extend_schema_field, extend_schema_view
from rest_framework import serializers, status, viewsets
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response

from dashboard.api import writes
from dashboard.api.fields import (
    StrictDecimalField,
    StrictModelSerializer,
    StrictPrimaryKeyRelatedField,
    UrlOrBlankField,
    non_negative_decimal,
)
from dashboard.api.guards import RefuseNulMixin
from dashboard.api.schema import BUDGET_REFUSED
from keys.models import ApiKey, Budget
from teams.access import administered_members, visible_budgets, visible_keys
from teams.models import Team

AMOUNT = cast(db.DecimalField, Budget._meta.get_field("amount"))


def _help(name: str) -> str:
    return str(cast(db.Field, Budget._meta.get_field(name)).help_text)


class BudgetSerializer(serializers.ModelSerializer):
    """A budget as read, with whose it is in words."""

    scope = serializers.CharField(
        source="scope_text",
        read_only=True,
        help_text="Whose budget it is, as a refusal names it: key “bot”, ana in team “search”, team “search”.",
    )
    alert_url = UrlOrBlankField(read_only=True, help_text=_help("alert_url"))

    class Meta:
        model = Budget
        fields = [
            "id", "scope", "key", "team", "user", "amount", "window", "timezone", "soft_limit_percent", "alert_url",
            "created_at",
        ]  # fmt: skip
        read_only_fields = fields


@extend_schema_field(non_negative_decimal(AMOUNT.max_digits or 0, AMOUNT.decimal_places or 0))
class AmountField(StrictDecimalField):
    """A budget's amount as written: a JSON number or the decimal string reads give, exact; never negative."""

    def __init__(self, **kwargs: Any) -> None:
        negative = next(v.message for v in AMOUNT.validators if isinstance(v, MinValueValidator))
        super().__init__(
            max_digits=AMOUNT.max_digits,
            decimal_places=AMOUNT.decimal_places,
            min_value=Decimal(0),
            error_messages={"min_value": negative},  # the model's own words, as the admin says it
            help_text=str(AMOUNT.help_text),
            **kwargs,
        )


def _row(queryset: Any, field: str) -> StrictPrimaryKeyRelatedField:
    return StrictPrimaryKeyRelatedField(queryset=queryset, required=False, allow_null=True, help_text=_help(field))


class BudgetWriteSerializer(StrictModelSerializer):
    """A budget as written: one scope (`key`; `team` and `user`; or `team`), its amount, window and alert."""

    key = _row(ApiKey.objects.all(), "key")
    team = _row(Team.objects.all(), "team")
    user = _row(get_user_model().objects.all(), "user")
    amount = AmountField()
    alert_url = UrlOrBlankField(required=False, help_text=_help("alert_url"))

    class Meta:
        model = Budget
        fields = ["key", "team", "user", "amount", "window", "timezone", "soft_limit_percent", "alert_url"]
        validators: list[Any] = []  # one budget per scope and window: writes.save_budget, naming the field

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        user = getattr(self.context.get("request"), "user", None)
        # A key or user the asker may not see is no row to them: a 400 as for an id that exists nowhere. (No one
        # signed in is the schema's generation: the API itself lets no one in unsigned.)
        if user is not None and user.is_authenticated:
            fields["key"] = _row(visible_keys(user), "key")
            fields["user"] = _row(administered_members(user), "user")
        return fields


BUDGET_WRITTEN = {400: BUDGET_REFUSED, 403: BUDGET_REFUSED}


@extend_schema_view(
    create=extend_schema(request=BudgetWriteSerializer, responses={201: BudgetSerializer, **BUDGET_WRITTEN}),
    update=extend_schema(request=BudgetWriteSerializer, responses={200: BudgetSerializer, **BUDGET_WRITTEN}),
    partial_update=extend_schema(
        request=BudgetWriteSerializer(partial=True), responses={200: BudgetSerializer, **BUDGET_WRITTEN}
    ),
)
class BudgetViewSet(RefuseNulMixin, viewsets.ModelViewSet):
    """The budgets you may see (teams.access.visible_budgets); created, changed and deleted by operators and by a
    team's admins within their team."""

    queryset = Budget.objects.none()
    serializer_class = BudgetSerializer
    permission_classes = [IsAuthenticated]
    lookup_value_regex = "[^/]+"  # any id reaches the view: a JSON 404 for one that is no budget's

    def get_queryset(self):
        return visible_budgets(self.request.user).select_related("key", "team", "user").order_by("id")

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        writes.check_sets_budgets(request.user)
        budget = writes.save_budget(request.user, Budget(**self._body(request)))
        return Response(BudgetSerializer(budget).data, status=status.HTTP_201_CREATED)

    def update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        budget = self.get_object()
        writes.check_changes_budget(request.user, budget)
        for name, value in self._body(request, partial=kwargs.get("partial", False)).items():
            setattr(budget, name, value)
        return Response(BudgetSerializer(writes.save_budget(request.user, budget)).data)

    def perform_destroy(self, instance: Budget) -> None:
        writes.delete_budget(self.request.user, instance)

    def _body(self, request: Request, partial: bool = False) -> dict[str, Any]:
        body = BudgetWriteSerializer(data=request.data, partial=partial, context=self.get_serializer_context())
        body.is_valid(raise_exception=True)
        return dict(body.validated_data)
