"""App configuration for dashboard."""

from django.apps import AppConfig


class DashboardConfig(AppConfig):
    """The dashboard app."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "dashboard"
