"""ASGI entry point of the router in router-only mode (`manage.py router --endpoint MODEL=URL ...`).

The command hands the table to each uvicorn worker in the environment
variable `LLMGW_ROUTER_STATIC_TABLE` (JSON, as `static_table.encode_table`
writes it and `decode_table_variable` reads it): a hand-off between the command and its own workers, not a
setting. Key changes are heard from Redis when REDIS_URL is set.
"""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
django.setup()

from django.conf import settings  # noqa: E402  (needs django.setup() first)

from hub import RedisHub  # noqa: E402
from router.app import create_app  # noqa: E402
from router.static_table import TABLE_VARIABLE, StaticHub, decode_table_variable  # noqa: E402

application = create_app(
    StaticHub(
        decode_table_variable(os.environ[TABLE_VARIABLE]),
        key_changes=RedisHub(settings.REDIS_URL) if settings.REDIS_URL else None,
    )
)
