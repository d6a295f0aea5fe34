"""App configuration for agent."""

from django.apps import AppConfig


class AgentConfig(AppConfig):
    """The agent app."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "agent"
