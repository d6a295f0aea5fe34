"""URLs under /api/v1/ (included from llmgw_site.urls)."""

from django.urls import re_path
from rest_framework.routers import DefaultRouter

from .views import ModelViewSet, NodeViewSet, ReplicaViewSet, StatusView

router = DefaultRouter()
# Scripts tend to leave the trailing slash off; accept both (the constructor only knows "/" or "").
router.trailing_slash = "/?"
router.register("models", ModelViewSet, basename="model")
router.register("nodes", NodeViewSet, basename="node")
router.register("replicas", ReplicaViewSet, basename="replica")

urlpatterns = [re_path(r"^status/?$", StatusView.as_view(), name="api-status"), *router.urls]
