"""ASGI entry point of the router in router-only mode (`manage.py router --endpoint MODEL=URL ...`).

The command hands the table to each uvicorn worker in the environment
variable `LLMGW_ROUTER_STATIC_TABLE` (JSON, as `static_table.encode_table`
writes it and `decode_table_variable` reads it): a hand-off between the command and its own workers, not a
setting, and kept out of argv since it may hold engines' keys. With REDIS_URL set, usage reports, rate-limit
counts, token counts and key changes go through Redis, shared with every other worker and router using it.
"""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
django.setup()

from django.conf import settings  # noqa: E402  (needs django.setup() first)

from router.endpoints.static import TABLE_VARIABLE, create_router_only_app, decode_table_variable  # noqa: E402

application = create_router_only_app(decode_table_variable(os.environ[TABLE_VARIABLE]), settings.REDIS_URL or "")
