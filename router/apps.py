"""App configuration for router."""

from django.apps import AppConfig


class RouterConfig(AppConfig):
    """The router app: the `router` command, and the migration history of the key tables it once held."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "router"
