"""App configuration for keys."""

from django.apps import AppConfig
from django.db.models.signals import post_delete, post_save, pre_save


class KeysConfig(AppConfig):
    """The keys app; connects the receivers that push changes of API keys and their budgets to every router."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "keys"
    verbose_name = "API keys"

    def ready(self) -> None:
        # Imported here: Django wants models loaded before receivers that name them.
        from keys.changes import budget_deleted, budget_saved, budget_saving, key_deleted, key_saved
        from keys.models import ApiKey, Budget

        post_save.connect(key_saved, sender=ApiKey, dispatch_uid="keys.key_saved")
        post_delete.connect(key_deleted, sender=ApiKey, dispatch_uid="keys.key_deleted")
        pre_save.connect(budget_saving, sender=Budget, dispatch_uid="keys.budget_saving")
        post_save.connect(budget_saved, sender=Budget, dispatch_uid="keys.budget_saved")
        post_delete.connect(budget_deleted, sender=Budget, dispatch_uid="keys.budget_deleted")
