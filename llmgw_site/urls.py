"""Control-plane URLs: admin (with the dashboard as its index), API, metrics."""

from django.contrib import admin
from django.urls import include, path

import dashboard.metrics  # noqa: F401  (registers the fleet gauges served at /metrics)

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("dashboard.api.urls")),
    path("", include("django_prometheus.urls")),
]
