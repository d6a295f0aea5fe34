"""App configuration for the embedded runner."""

from django.apps import AppConfig


class RunnerConfig(AppConfig):
    """The embedded runner (`manage.py up`)."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "runner"
    verbose_name = "embedded runner"
