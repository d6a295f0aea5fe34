"""App configuration for reconciler."""

from django.apps import AppConfig


class ReconcilerConfig(AppConfig):
    """The reconciler app."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "reconciler"
