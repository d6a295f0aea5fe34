"""Control-plane URLs: admin (with the dashboard as its index), API, metrics."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

import dashboard.metrics  # noqa: F401  (registers the fleet gauges served at /metrics)

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/")),  # the dashboard is the home page
    path("admin/", admin.site.urls),
    path("api/v1/", include("dashboard.api.urls")),
    path("", include("django_prometheus.urls")),
]
