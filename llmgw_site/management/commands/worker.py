"""`manage.py worker` (`llmgw worker`): a Celery worker that campaigns for the lease and, while it leads, runs
the reconcile ticks (docs/running.md): one pool slot, its own name, the queues the leader protocol needs."""

import socket
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from llmgw_site.celery import app


class Command(BaseCommand):
    help = "Run a reconciler worker (Celery): it campaigns for the lease and runs ticks while it holds it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--name", default=f"reconciler@{socket.gethostname()}", help="The worker's name, unique in the fleet."
        )
        parser.add_argument("--loglevel", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    def handle(self, *args: Any, name: str, loglevel: str, **options: Any) -> None:
        # The only pool the leader protocol allows (ticks one at a time beside the campaign thread); consumes
        # `celery`, and `reconcile-leader` only while leading.
        argv = f"worker -n {name} --pool solo -Q celery --without-mingle --without-gossip --loglevel {loglevel}"
        app.worker_main(argv.split())
