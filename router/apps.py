"""App configuration for router."""

from django.apps import AppConfig
from django.db.models.signals import post_delete, post_save


class RouterConfig(AppConfig):
    """The router app; connects the receivers that push API-key changes to every router."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "router"

    def ready(self) -> None:
        # Imported here: Django wants models loaded before receivers that name them.
        from .key_changes import key_deleted, key_saved
        from .models import ApiKey

        post_save.connect(key_saved, sender=ApiKey, dispatch_uid="router.key_saved")
        post_delete.connect(key_deleted, sender=ApiKey, dispatch_uid="router.key_deleted")
