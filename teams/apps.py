"""App configuration for teams."""

from django.apps import AppConfig
from django.db.models.signals import post_delete, post_save


class TeamsConfig(AppConfig):
    """The teams app; connects the receivers that push a team's changes to the routers caching its keys."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "teams"

    def ready(self) -> None:
        # Imported here: Django wants models loaded before receivers that name them.
        from teams.changes import member_left, team_saved
        from teams.models import Membership, Team

        post_save.connect(team_saved, sender=Team, dispatch_uid="teams.team_saved")
        post_delete.connect(member_left, sender=Membership, dispatch_uid="teams.member_left")
