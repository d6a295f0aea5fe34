"""Control-plane URLs: admin (with the dashboard as its index), API, metrics, and the self-service pages of the
people of each team (/me/)."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

from dashboard.metrics import metrics_view  # importing it registers the fleet gauges served at /metrics

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/")),  # the dashboard is the home page
    path("admin/", admin.site.urls),
    path("api/v1/", include("dashboard.api.urls")),
    path("me/", include("teams.urls")),
    # django_prometheus's exporter, behind LLMGW_METRICS_TOKEN when set.
    path("metrics", metrics_view, name="prometheus-django-metrics"),
]
