"""App configuration for router."""

from django.apps import AppConfig


class RouterConfig(AppConfig):
    """The router app."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "router"
