"""URLs under /api/v1/ (included from llmgw_site.urls)."""

from django.urls import re_path
from rest_framework.renderers import JSONOpenAPIRenderer
from rest_framework.routers import DefaultRouter
from rest_framework.schemas import get_schema_view

from .views import ModelViewSet, NodeViewSet, ReplicaViewSet, StatusView, TokenUsageViewSet

router = DefaultRouter()
# Scripts tend to leave the trailing slash off; accept both (the constructor only knows "/" or "").
router.trailing_slash = "/?"
router.register("models", ModelViewSet, basename="model")
router.register("nodes", NodeViewSet, basename="node")
router.register("replicas", ReplicaViewSet, basename="replica")
router.register("usage", TokenUsageViewSet, basename="usage")

schema_view = get_schema_view(
    title="llmgw API",
    description="Read the fleet: status summary, models, nodes, replicas, token usage per key, model and hour.",
    version="1",
    renderer_classes=[JSONOpenAPIRenderer],
)

urlpatterns = [
    re_path(r"^status/?$", StatusView.as_view(), name="api-status"),
    re_path(r"^schema/?$", schema_view, name="api-schema"),
    *router.urls,
]
