"""`manage.py server` (`llmgw server`): the control plane's HTTP server: the admin and dashboard, the REST API,
the agents' WebSocket, /metrics and the probes, under uvicorn, with TLS from the LLMGW_TLS_* settings."""

from typing import Any

import uvicorn
from django.core.management.base import BaseCommand, CommandError, CommandParser

from llmgw_site.probes import quiet_probes
from runner.embedded import control_plane_options


class Command(BaseCommand):
    help = (
        "Run the control plane's HTTP server (admin, /api/v1, /agent/ws, /metrics, /healthz, /readyz). "
        "Run as many as you like behind a load balancer; they share the database and Redis."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (default 127.0.0.1).")
        parser.add_argument("--port", type=int, default=8000, help="Port to listen on (default 8000).")
        parser.add_argument(
            "--access-log", action="store_true", help="Log every request but the probes (default: warnings only)."
        )

    def handle(self, *args: Any, host: str, port: int, access_log: bool, **options: Any) -> None:
        if not 0 < port < 65536:
            raise CommandError(f"--port {port}: give a port between 1 and 65535")
        settings = control_plane_options() | {"lifespan": "off", "log_level": "info" if access_log else "warning"}
        quiet_probes()
        uvicorn.run("llmgw_site.asgi:application", host=host, port=port, **settings)
