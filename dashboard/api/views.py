"""REST API views: thin; the summary, lists (a fixed number of queries each) and writes through `writes`."""

from datetime import UTC, datetime

from django.db.models import Prefetch, Q
from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from catalog.models import Model
from dashboard.api import writes
from dashboard.api.fields import parse_date_or_time
from dashboard.api.guards import RefuseNulMixin
from dashboard.api.schema import KEY_REFUSED, MODEL_WRITE_REFUSED
from dashboard.api.serializers import (
    ApiKeySerializer,
    DrainedSerializer,
    ModelSerializer,
    ModelWrittenSerializer,
    NewApiKeySerializer,
    NodeSerializer,
    ReplicaSerializer,
    TokenUsageSerializer,
)
from dashboard.api.status import StatusSerializer
from dashboard.api.write_serializers import ApiKeyWriteSerializer, ModelReplaceSerializer, ModelWriteSerializer
from dashboard.summary import cluster_summary
from inventory.models import Node
from keys.models import ApiKey, TokenUsage
from reconciler.adapters import HELD
from reconciler.choices import ReplicaState
from reconciler.models import AdapterLoad, Replica
from teams.access import is_operator, visible_keys, visible_usage


class StatusView(APIView):
    """GET /api/v1/status: `cluster_summary()`, the same data ctl_status and the dashboard show."""

    @extend_schema(responses=StatusSerializer)
    def get(self, request):
        return Response(cluster_summary().as_json())


@extend_schema_view(
    create=extend_schema(
        request=ModelWriteSerializer, responses={201: ModelWrittenSerializer, 400: MODEL_WRITE_REFUSED}
    ),
    update=extend_schema(
        request=ModelReplaceSerializer, responses={200: ModelWrittenSerializer, 400: MODEL_WRITE_REFUSED}
    ),
    partial_update=extend_schema(
        request=ModelReplaceSerializer(partial=True), responses={200: ModelWrittenSerializer, 400: MODEL_WRITE_REFUSED}
    ),
)
class ModelViewSet(RefuseNulMixin, viewsets.ModelViewSet):
    """Catalog models with their aliases and profiles; `{name}` is a model's name or one of its aliases.

    Writes take the catalog file's entry shape and its checks (`catalog apply`).
    PUT replaces the whole entry; PATCH replaces only the keys it gives (a given
    `aliases` or `profiles` list replaces that whole list). Profiles are kept by
    position, as `catalog apply` does; deleting a model takes its replicas.
    """

    queryset = Model.objects.prefetch_related("aliases", "profiles", "adapters").order_by("name")
    serializer_class = ModelSerializer
    lookup_field = "name"
    # Model names may hold "/" (hub ids such as meta-llama/Llama-3-8B), so the name is the rest of the path.
    lookup_value_regex = r"[\s\S]+"

    def get_object(self):
        name = self.kwargs["name"]
        found = self._named(name)
        if found is None and name.endswith("/"):
            found = self._named(name.rstrip("/"))  # the optional trailing slash, swallowed by the name
        if found is None:
            raise Http404(f"No model or alias named “{name.rstrip('/')}”.")
        self.check_object_permissions(self.request, found)
        return found

    def _named(self, name: str) -> Model | None:
        return self.get_queryset().filter(Q(name=name) | Q(aliases__name=name)).distinct().first()

    def create(self, request, *args, **kwargs):
        model = writes.create_model(request.data)
        return Response(ModelWrittenSerializer(model).data, status=status.HTTP_201_CREATED)

    def update(self, request, *args, **kwargs):
        model = writes.update_model(self.get_object(), request.data, partial=kwargs.get("partial", False))
        return Response(ModelWrittenSerializer(model).data)


@extend_schema_view(
    cordon=extend_schema(request=None, responses=NodeSerializer),
    uncordon=extend_schema(request=None, responses=NodeSerializer),
    drain=extend_schema(request=None, responses=DrainedSerializer),
)
class NodeViewSet(RefuseNulMixin, viewsets.ReadOnlyModelViewSet):
    """Nodes with their GPUs; cordon, uncordon and drain (cordon, then stop its replicas)."""

    queryset = Node.objects.prefetch_related("gpus").order_by("name")
    serializer_class = NodeSerializer
    lookup_field = "name"
    lookup_value_regex = "[^/]+"

    @action(detail=True, methods=["post"])
    def cordon(self, request, name=None):
        return Response(NodeSerializer(writes.set_cordoned(self.get_object(), True)).data)

    @action(detail=True, methods=["post"])
    def uncordon(self, request, name=None):
        return Response(NodeSerializer(writes.set_cordoned(self.get_object(), False)).data)

    @action(detail=True, methods=["post"])
    def drain(self, request, name=None):
        node = self.get_object()
        stopped = writes.drain_node(node)
        return Response({"node": NodeSerializer(node).data, "replicas_stopped": stopped})


STATE_FILTER = OpenApiParameter("state", OpenApiTypes.STR, enum=list(ReplicaState.values), description="Only these.")


@extend_schema_view(
    list=extend_schema(parameters=[STATE_FILTER]),
    stop=extend_schema(request=None, responses=ReplicaSerializer),
    drain=extend_schema(request=None, responses=ReplicaSerializer),
)
class ReplicaViewSet(RefuseNulMixin, viewsets.ReadOnlyModelViewSet):
    """Replicas with their nodes, GPU count, idle time and LoRA adapters; stop (or drain) one gracefully."""

    queryset = (
        Replica.objects.select_related("model", "profile")
        .prefetch_related(
            "shards__node",
            "shards__gpu_assignments",
            # The loads taking a slot (loading, loaded), with their adapters' names: one query for the page.
            Prefetch(
                "adapter_loads",
                AdapterLoad.objects.filter(state__in=HELD).select_related("adapter").order_by("adapter__name"),
            ),
        )
        .order_by("id")
    )
    serializer_class = ReplicaSerializer
    # Any segment reaches the view, so a non-number is this API's JSON 404, not Django's HTML one.
    lookup_value_regex = "[^/]+"

    def get_queryset(self):
        queryset = super().get_queryset()
        state = self.request.query_params.get("state")
        if state is not None and state not in ReplicaState.values:
            raise ValidationError({"state": f"{state!r} is not one of {', '.join(ReplicaState.values)}."})
        return queryset.filter(state=state) if state else queryset

    def _stopped(self, reason: str) -> Response:
        replica = self.get_object()
        writes.stop_one_replica(replica, reason)
        fresh = self.get_queryset().filter(pk=replica.pk).first()
        # A replica with no shards is deleted at once; answer with what it was.
        return Response(ReplicaSerializer(fresh or replica, context={"request": self.request}).data)

    @action(detail=True, methods=["post"])
    def stop(self, request, pk=None):
        return self._stopped("stopped by an operator (API)")

    @action(detail=True, methods=["post"])
    def drain(self, request, pk=None):
        return self._stopped("drained by an operator (API)")


@extend_schema_view(
    create=extend_schema(
        request=ApiKeyWriteSerializer, responses={201: NewApiKeySerializer, 400: KEY_REFUSED, 403: KEY_REFUSED}
    ),
    revoke=extend_schema(request=None, responses=ApiKeySerializer),
)
class ApiKeyViewSet(RefuseNulMixin, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Router API keys: list, create (the secret is in this one answer), revoke (routers refuse it within a second).

    Open to every signed-in user, each seeing only what teams.access allows:
    operators every key, a team's admins its keys, anyone their own. A key
    someone else may not see is a 404, never a 403 that says it exists.
    """

    queryset = ApiKey.objects.none()
    serializer_class = ApiKeySerializer
    permission_classes = [IsAuthenticated]
    lookup_value_regex = "[^/]+"

    def get_queryset(self):
        return visible_keys(self.request.user).order_by("name", "id")

    def create(self, request, *args, **kwargs):
        serializer = ApiKeyWriteSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        fields = dict(serializer.validated_data)
        if not is_operator(request.user):
            fields["user"] = request.user  # a member's key is their own, in a team of theirs
            writes.check_own_team(request.user, fields.get("team"))
            writes.check_priority_class(fields.get("priority_class", ""), fields["team"])
        key, secret = writes.issue_key(fields)
        return Response({**ApiKeySerializer(key).data, "key": secret}, status=status.HTTP_201_CREATED)

    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        return Response(ApiKeySerializer(writes.revoke_key(self.get_object())).data)


# What `since` takes, as the schema says it: an RFC 3339 date-time, or a full date.
SINCE = {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "string", "format": "date"}]}


@extend_schema_view(
    list=extend_schema(
        parameters=[
            OpenApiParameter("key", OpenApiTypes.STR, description="The key's name."),
            OpenApiParameter("model", OpenApiTypes.STR),
            OpenApiParameter(
                "since",
                SINCE,
                description="An RFC 3339 date-time (2026-01-31T14:00:00Z) or a date (2026-01-31, midnight UTC).",
            ),
        ]
    )
)
class TokenUsageViewSet(RefuseNulMixin, mixins.ListModelMixin, viewsets.GenericViewSet):
    """GET /api/v1/usage/: tokens per API key, model and hour, newest hour first.

    Filters: `key` (the key's name), `model`, `since` (an RFC 3339 date-time
    or a date, midnight UTC; rows of the hour containing it and later).
    """

    queryset = TokenUsage.objects.none()
    serializer_class = TokenUsageSerializer
    permission_classes = [IsAuthenticated]  # each user the usage of the keys they may see (teams.access)

    def get_queryset(self):
        queryset = visible_usage(self.request.user).order_by("-hour", "key_name", "model", "id")
        params = self.request.query_params
        if key := params.get("key"):
            queryset = queryset.filter(key_name=key)
        if model := params.get("model"):
            queryset = queryset.filter(model=model)
        # Given empty, it is no date: a 400, as the schema says, not "no filter".
        if (since := params.get("since")) is not None:
            queryset = queryset.filter(hour__gte=_hour_of(since))
        return queryset


def _hour_of(text: str) -> datetime:
    """The start of the hour an RFC 3339 date-time or a date (midnight UTC) falls in; 400 if it is neither."""
    at = parse_date_or_time(text)
    if at is None:
        raise ValidationError(
            {"since": f"{text[:40]!r} is not an RFC 3339 date-time or a date (e.g. 2026-01-31T14:00:00Z, 2026-01-31)."}
        )
    try:
        at = at.astimezone(UTC)
    except OverflowError:
        # Within a day of the calendar's ends: from before any row, or after every one.
        at = datetime.min.replace(tzinfo=UTC) if at.year == 1 else datetime.max.replace(tzinfo=UTC)
    return at.replace(minute=0, second=0, microsecond=0)
