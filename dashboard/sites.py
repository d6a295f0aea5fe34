"""The admin site whose index page is the cluster dashboard."""

from django.contrib.admin import AdminSite

from .views import dashboard_context


class FleetAdminSite(AdminSite):
    """Django admin for llmgw; its index shows the cluster summary above the app list."""

    site_header = "llmgw"
    site_title = "llmgw"
    index_title = "Fleet"
    index_template = "dashboard/admin_index.html"

    def index(self, request, extra_context=None):
        return super().index(request, extra_context={**dashboard_context(), **(extra_context or {})})
