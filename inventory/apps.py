"""App configuration for inventory."""

from django.apps import AppConfig


class InventoryConfig(AppConfig):
    """The inventory app."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "inventory"
