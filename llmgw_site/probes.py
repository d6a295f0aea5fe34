"""The control plane's liveness and readiness probes, answered before Django's request cycle.

`/healthz` says the process answers (200 while its event loop runs).
`/readyz` says it can do its job: its database answers a query and, in a
distributed deployment (REDIS_URL set), Redis answers a PING; each within
PROBE_TIMEOUT_SECONDS. A failed check is a 503 naming it. Both are answered
here, in front of Django: no session, no auth, no CSRF, and not counted in
the request metrics, so a kubelet can poll them every second for the cost of
a query and a PING. The access log leaves them out too (`quiet_probes`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio
from channels.db import database_sync_to_async
from django.conf import settings
from django.db import connection

PROBE_PATHS = frozenset({"/healthz", "/readyz"})
# Past this, a check counts as failed: a probe must answer before the prober gives up on it.
PROBE_TIMEOUT_SECONDS = 2.0

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]  # Django's handler types receive and send loosely


@database_sync_to_async
def _query_database() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()


class Probes:
    """ASGI middleware answering /healthz and /readyz; every other request goes to `app`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._redis: redis.asyncio.Redis | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/healthz":
            await _answer(send, 200, {"status": "alive"})
            return
        failed = await self.failed_checks()
        if failed:
            await _answer(send, 503, {"status": "not_ready", "failed": failed})
        else:
            await _answer(send, 200, {"status": "ready"})

    async def failed_checks(self) -> dict[str, str]:
        """Check name -> what went wrong, for every check that failed (empty: ready)."""
        checks = {"database": _query_database()}
        if settings.REDIS_URL:
            checks["redis"] = self._ping_redis()
        results = await asyncio.gather(*(_within_timeout(check) for check in checks.values()))
        return {name: problem for name, problem in zip(checks, results, strict=True) if problem}

    async def _ping_redis(self) -> None:
        if self._redis is None:
            self._redis = redis.asyncio.from_url(
                str(settings.REDIS_URL),
                socket_connect_timeout=PROBE_TIMEOUT_SECONDS,
                socket_timeout=PROBE_TIMEOUT_SECONDS,
            )
        await self._redis.ping()


async def _within_timeout(check: Awaitable[None]) -> str:
    """'' when `check` succeeds in time, else what went wrong."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_SECONDS):
            await check
    except TimeoutError:
        return f"no answer within {PROBE_TIMEOUT_SECONDS:g} s"
    except Exception as exc:  # any failure of the dependency is the probe's answer, not the probe's failure
        return f"{type(exc).__name__}: {exc}".strip()
    return ""


async def _answer(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class _ProbeLines(logging.Filter):
    """Drops uvicorn's access-log lines of probe requests."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) >= 3 and str(args[2]).split("?")[0] in PROBE_PATHS)


def quiet_probes() -> None:
    """Leave probe requests out of uvicorn's access log (its record's args: client, method, path, …)."""
    logging.getLogger("uvicorn.access").addFilter(_ProbeLines())
