"""The admin site whose index page is the cluster dashboard, plus the panels fragment it refreshes from."""

from django.contrib.admin import AdminSite
from django.urls import path

from dashboard.views import dashboard_context, panels_view
from dashboard.will_it_fit import will_it_fit_view


class FleetAdminSite(AdminSite):
    """Django admin for llmgw; its index shows the cluster summary above the app list.

    `/admin/panels/` serves the same panels alone; the index's fetch loop swaps
    them in every few seconds, so the page stays live without a reload.
    `/admin/plan/` is the "Will it fit?" form.
    """

    site_header = "llmgw"
    site_title = "llmgw"
    index_title = "Fleet"
    index_template = "dashboard/admin_index.html"

    def get_urls(self):
        # admin_view: staff only, like every admin page (others are sent to the login page).
        return [
            path("panels/", self.admin_view(panels_view), name="dashboard_panels"),
            path("plan/", self.admin_view(self.will_it_fit), name="will_it_fit"),
            *super().get_urls(),
        ]

    def will_it_fit(self, request):
        return will_it_fit_view(request, self.each_context(request))

    def index(self, request, extra_context=None):
        return super().index(request, extra_context={**dashboard_context(), **(extra_context or {})})
