"""`manage.py router`: run the production router (uvicorn, uvloop, httptools), following the hub or on a fixed table."""

import os
from typing import Any

import uvicorn
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from uvicorn.importer import import_from_string

from hub.contracts import EndpointTable
from router.endpoints.file import load_endpoints_file
from router.endpoints.static import (
    TABLE_VARIABLE,
    EndpointSpecError,
    StaticTableSpec,
    build_table,
    describe_table,
    encode_table,
    parse_endpoint_options,
)
from router.serving import GracefulServer, server_config, server_options

HUB_APP = "router.asgi:application"
STATIC_APP = "router.standalone:application"


class Command(BaseCommand):
    help = (
        "Run the router. Without --endpoint/--endpoints it follows the control plane through the hub (Redis when "
        "REDIS_URL is set); with --endpoint MODEL=URL (repeatable) and/or --endpoints FILE it serves those engines "
        "on their own, with no control plane."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (default 127.0.0.1).")
        parser.add_argument("--port", type=int, default=8080, help="Port to listen on (default 8080).")
        parser.add_argument("--workers", type=int, default=1, help="Router processes sharing the port (default 1).")
        parser.add_argument(
            "--endpoint",
            action="append",
            default=[],
            metavar="MODEL=URL",
            help="Serve MODEL from the OpenAI-compatible engine at URL (repeatable; repeat a model for more URLs).",
        )
        parser.add_argument(
            "--alias",
            action="append",
            default=[],
            metavar="ALIAS=MODEL",
            help="Another name for a model served here (repeatable).",
        )
        parser.add_argument(
            "--endpoints",
            metavar="FILE",
            help="A YAML file of models, their engines (with their API keys) and aliases; adds to --endpoint.",
        )

    def handle(self, *args: Any, host: str, port: int, workers: int, **options: Any) -> None:
        if not 0 < port < 65536:
            raise CommandError(f"--port {port}: must be between 1 and 65535")
        if workers < 1:
            raise CommandError(f"--workers {workers}: must be at least 1")
        app = HUB_APP
        if options["endpoint"] or options["alias"] or options["endpoints"]:
            table = self._static_table(options["endpoints"], options["endpoint"], options["alias"])
            # Inherited by every worker process, which builds its app from it (router.standalone): the
            # environment, not argv, since it may hold engines' keys.
            os.environ[TABLE_VARIABLE] = encode_table(table)
            app = STATIC_APP
            self.stderr.write(self.style.SUCCESS(f"router-only mode, no control plane: {describe_table(table)}"))
            if workers > 1 and not settings.REDIS_URL:
                self.stderr.write(
                    self.style.WARNING(
                        f"WARNING: REDIS_URL is not set, so each of the {workers} workers keeps its own rate limits: "
                        f"a key may get up to {workers}× its limit. Set REDIS_URL to share them."
                    )
                )
        grace = settings.LLMGW_SHUTDOWN_GRACE_SECONDS
        if workers == 1:
            # One process: on SIGTERM the app refuses new requests at once and streams finish within the grace.
            GracefulServer(server_config(import_from_string(app), host=host, port=port, grace=grace)).run()
            return
        # Each worker closes its listener on SIGTERM and lets requests in flight finish for the grace.
        uvicorn.run(app, host=host, port=port, workers=workers, **server_options(grace))

    def _static_table(self, path: str | None, endpoints: list[str], aliases: list[str]) -> EndpointTable:
        """The table of the file (if any) and the options, checked whole; a CommandError naming the problem."""
        try:
            spec = load_endpoints_file(path) if path else StaticTableSpec()
            spec.extend(parse_endpoint_options(endpoints, aliases))
            return build_table(spec)
        except EndpointSpecError as exc:
            raise CommandError(str(exc)) from None
