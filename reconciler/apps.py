"""App configuration for reconciler."""

from django.apps import AppConfig


class ReconcilerConfig(AppConfig):
    """The reconciler app."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "reconciler"

    def ready(self) -> None:
        # Imported here, as Django asks: the receivers import models, which are ready only now.
        from reconciler import catalog_changes
        from reconciler.weights import removal as weights_removal

        catalog_changes.connect()
        weights_removal.connect()
