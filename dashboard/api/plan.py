"""POST /api/v1/plan: will these models fit? The planner's answer (reconciler.planner.what_if), no writes.

The body takes catalog-format model entries (`models`, the shape of a catalog
file's `models:` list and of POST /api/v1/models) and/or catalog models by name
or alias (`names`); the entries are planned first, then the names, in order and
cumulatively. The answer's schema is derived from the planner's dataclasses.
"""

from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView
from rest_framework_dataclasses.serializers import DataclassSerializer

from dashboard.api.fields import RefuseUnknownKeys, StrictCharField
from dashboard.api.guards import RefuseNulMixin
from dashboard.api.schema import PLAN_REFUSED
from reconciler.planner.answer import PlanAnswer
from reconciler.planner.what_if import PlanInputError, plan_request

MAX_MODELS = 100
"""Models one request may plan (entries and names together): an answer, not a bulk job."""


class PlanRequestSerializer(RefuseUnknownKeys):
    """What to plan: catalog-format entries, catalog model names, or both (at least one model)."""

    models = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        max_length=MAX_MODELS,
        help_text="Catalog-format model entries (name, source, profiles, ...), as in a catalog file; planned first.",
    )
    names = serializers.ListField(
        child=StrictCharField(max_length=255),
        required=False,
        max_length=MAX_MODELS,
        help_text="Catalog models by name or alias; planned after `models`.",
    )

    def validate(self, attrs):
        count = len(attrs.get("models", [])) + len(attrs.get("names", []))
        if not count:
            raise ValidationError({"detail": "nothing to plan: give `models` (catalog-format entries) or `names`"})
        if count > MAX_MODELS:
            raise ValidationError({"detail": f"at most {MAX_MODELS} models in one request, got {count}"})
        return attrs


class PlanAnswerSerializer(DataclassSerializer):
    """Per model: fits (where), fits_after_stopping (what to stop, what each frees) or does_not_fit (why)."""

    class Meta:
        dataclass = PlanAnswer


class PlanView(RefuseNulMixin, APIView):
    """POST /api/v1/plan: the planner's answer for the models asked; nothing is written."""

    @extend_schema(request=PlanRequestSerializer, responses={200: PlanAnswerSerializer, 400: PLAN_REFUSED})
    def post(self, request):
        body = PlanRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        models, names = body.validated_data.get("models"), body.validated_data.get("names")
        try:
            answer = plan_request({"models": models} if models else None, names, timezone.now())
        except PlanInputError as exc:
            raise ValidationError({exc.part or "detail": exc.messages}) from None
        return Response(answer.to_json())
