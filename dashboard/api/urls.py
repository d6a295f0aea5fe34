"""URLs under /api/v1/ (included from llmgw_site.urls): the router's viewsets, status, plan, showback, schema and
Swagger UI."""

from collections import OrderedDict

from django.urls import re_path
from drf_spectacular.views import SpectacularJSONAPIView, SpectacularSwaggerView
from rest_framework.routers import APIRootView, DefaultRouter

from dashboard.api.budgets import BudgetViewSet
from dashboard.api.plan import PlanView
from dashboard.api.showback import ShowbackView
from dashboard.api.teams import TeamViewSet
from dashboard.api.views import ApiKeyViewSet, ModelViewSet, NodeViewSet, ReplicaViewSet, StatusView, TokenUsageViewSet


class RootView(APIRootView):
    """The API's endpoints: lists, plus status, plan, the OpenAPI schema and its Swagger UI."""

    api_root_dict = OrderedDict()


class Router(DefaultRouter):
    """DefaultRouter whose root also lists status, plan, schema and docs."""

    APIRootView = RootView

    def get_api_root_view(self, api_urls=None):
        names = {prefix: self.routes[0].name.format(basename=basename) for prefix, _, basename in self.registry}
        names.update({"status": "api-status", "plan": "api-plan", "showback": "api-showback"})
        names.update({"schema": "api-schema", "docs": "api-docs"})
        return self.APIRootView.as_view(api_root_dict=names)


router = Router()
# Scripts tend to leave the trailing slash off; accept both (the constructor only knows "/" or "").
router.trailing_slash = "/?"
router.register("models", ModelViewSet, basename="model")
router.register("nodes", NodeViewSet, basename="node")
router.register("replicas", ReplicaViewSet, basename="replica")
router.register("keys", ApiKeyViewSet, basename="apikey")
router.register("usage", TokenUsageViewSet, basename="usage")
router.register("teams", TeamViewSet, basename="team")
router.register("budgets", BudgetViewSet, basename="budget")

urlpatterns = [
    re_path(r"^status/?$", StatusView.as_view(), name="api-status"),
    re_path(r"^plan/?$", PlanView.as_view(), name="api-plan"),
    re_path(r"^showback/?$", ShowbackView.as_view(), name="api-showback"),
    re_path(r"^schema/?$", SpectacularJSONAPIView.as_view(), name="api-schema"),
    re_path(r"^docs/?$", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    *router.urls,
]
