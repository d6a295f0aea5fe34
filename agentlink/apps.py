"""App configuration for the agent link."""

from django.apps import AppConfig


class AgentLinkConfig(AppConfig):
    """The agent link: the WebSocket node agents hold at /agent/ws, above inventory and reconciler."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "agentlink"
    verbose_name = "agent link"
