"""ASGI entry point of the router, and its production server.

    uvicorn router.asgi:application --loop uvloop --http httptools
    python -m router.asgi [--host 127.0.0.1] [--port 8080]

Django is set up first because the router reads settings and, on an API-key
cache miss, the ORM. The hub is chosen by settings (Redis when REDIS_URL is
set). `python -m router.asgi` serves `application` with `router.serving`: on
SIGTERM it drains for LLMGW_SHUTDOWN_GRACE_SECONDS, then exits.
"""

import argparse
import os
import sys

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
django.setup()

from django.conf import settings  # noqa: E402  (needs django.setup() first)

from router.app import create_app  # noqa: E402
from router.serving import GracefulServer, server_config  # noqa: E402

application = create_app()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router.asgi", description="Serve the llmgw router.")
    parser.add_argument("--host", default=settings.LLMGW_HOST, help="address to listen on (LLMGW_HOST)")
    parser.add_argument("--port", type=int, default=settings.LLMGW_ROUTER_PORT, help="port (LLMGW_ROUTER_PORT)")
    args = parser.parse_args(argv)
    config = server_config(application, host=args.host, port=args.port, grace=settings.LLMGW_SHUTDOWN_GRACE_SECONDS)
    server = GracefulServer(config)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
