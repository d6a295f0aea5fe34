"""ASGI entry point of the router: `uvicorn router.asgi:application --loop uvloop --http httptools`.

Django is set up first because the router reads settings and, on an API-key
cache miss, the ORM. The hub is chosen by settings (Redis when REDIS_URL is set).
"""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
django.setup()

from router.app import create_app  # noqa: E402  (needs django.setup() first)

application = create_app()
