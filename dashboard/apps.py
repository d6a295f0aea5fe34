"""App configuration for the dashboard, and the admin site it replaces."""

from django.apps import AppConfig
from django.contrib.admin import apps as admin_apps


class DashboardConfig(AppConfig):
    """The dashboard app."""

    default = True
    default_auto_field = "django.db.models.BigAutoField"
    name = "dashboard"


class FleetAdminConfig(admin_apps.AdminConfig):
    """Django admin, with the cluster dashboard as its index page."""

    default = False
    default_site = "dashboard.sites.FleetAdminSite"
