"""REST API views: the cluster summary and read-only lists (a fixed number of queries each)."""

from rest_framework import viewsets
from rest_framework.response import Response
from rest_framework.views import APIView

from catalog.models import Model
from dashboard.summary import cluster_summary
from inventory.models import Node
from reconciler.models import Replica

from .serializers import ModelSerializer, NodeSerializer, ReplicaSerializer


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
