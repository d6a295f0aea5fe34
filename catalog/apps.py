"""App configuration for catalog."""

from django.apps import AppConfig


class CatalogConfig(AppConfig):
    """The catalog app."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "catalog"
