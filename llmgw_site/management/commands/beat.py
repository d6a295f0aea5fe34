"""`manage.py beat` (`llmgw beat`): Celery beat sending the reconcile ticks; run one per control-plane host, the
RedBeat lock in Redis lets one of them send (docs/running.md)."""

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from llmgw_site.celery import app


class Command(BaseCommand):
    help = "Run beat (Celery): it sends the reconcile ticks while it holds the RedBeat lock."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--loglevel", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    def handle(self, *args: Any, loglevel: str, **options: Any) -> None:
        app.start(["beat", "--loglevel", loglevel])
