"""REST API views: the cluster summary and read-only lists (a fixed number of queries each)."""

from datetime import UTC, datetime

from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from rest_framework import mixins, viewsets
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from catalog.models import Model
from dashboard.summary import cluster_summary
from inventory.models import Node
from reconciler.models import Replica
from router.models import TokenUsage

from .serializers import ModelSerializer, NodeSerializer, ReplicaSerializer, TokenUsageSerializer


class StatusView(APIView):
    """GET /api/v1/status: `cluster_summary()`, the same data ctl_status and the dashboard show."""

    def get(self, request):
        return Response(cluster_summary())


class ModelViewSet(viewsets.ReadOnlyModelViewSet):
    """Catalog models with their aliases and profiles."""

    queryset = Model.objects.prefetch_related("aliases", "profiles").order_by("name")
    serializer_class = ModelSerializer
    lookup_field = "name"
    lookup_value_regex = "[^/]+"


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    """Nodes with their GPUs."""

    queryset = Node.objects.prefetch_related("gpus").order_by("name")
    serializer_class = NodeSerializer
    lookup_field = "name"


class ReplicaViewSet(viewsets.ReadOnlyModelViewSet):
    """Replicas with their nodes, GPU count and idle time."""

    queryset = (
        Replica.objects.select_related("model")
        .prefetch_related("shards__node", "shards__gpu_assignments")
        .order_by("id")
    )
    serializer_class = ReplicaSerializer

    def get_queryset(self):
        queryset = super().get_queryset()
        state = self.request.query_params.get("state")
        return queryset.filter(state=state) if state else queryset


class TokenUsageViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """GET /api/v1/usage/: tokens per API key, model and hour, newest hour first.

    Filters: `key` (the key's name), `model`, `since` (an ISO 8601 date or
    time; rows of the hour containing it and later; UTC when no offset is given).
    """

    queryset = TokenUsage.objects.order_by("-hour", "key_name", "model", "id")
    serializer_class = TokenUsageSerializer

    def get_queryset(self):
        queryset = super().get_queryset()
        params = self.request.query_params
        if key := params.get("key"):
            queryset = queryset.filter(key_name=key)
        if model := params.get("model"):
            queryset = queryset.filter(model=model)
        if since := params.get("since"):
            queryset = queryset.filter(hour__gte=_hour_of(since))
        return queryset


def _hour_of(text: str) -> datetime:
    """The start of the hour an ISO 8601 date or time falls in (UTC unless it says otherwise); 400 if unreadable."""
    try:
        at = parse_datetime(text)
        if at is None and (day := parse_date(text)) is not None:
            at = datetime(day.year, day.month, day.day)
    except ValueError:
        at = None
    if at is None:
        raise ValidationError({"since": f"{text!r} is not an ISO 8601 date or time (e.g. 2026-01-31T14:00:00Z)."})
    if timezone.is_naive(at):
        at = at.replace(tzinfo=UTC)
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
