"""Raw ASGI I/O for the router: whole responses, the request body, and waiting for a disconnect.

The router speaks ASGI directly (no framework on the hot path); these are the
few message patterns it needs, typed once.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from router.errors import RouterError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_CONTENT_TYPE = b"application/json"


async def send_bytes(
    send: Send, status: int, body: bytes, content_type: bytes, extra_headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """A complete response with a known length."""
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if extra_headers:
        headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, payload: dict[str, Any]) -> None:
    await send_bytes(send, status, json.dumps(payload).encode(), JSON_CONTENT_TYPE)


async def read_body(receive: Receive, max_bytes: int) -> bytes | None:
    """The whole request body, or None if the client left before sending it; 413 past `max_bytes`."""
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise RouterError(413, f"Request body is larger than {max_bytes} bytes.", "body_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def until_disconnect(receive: Receive) -> None:
    """Return when the client has gone away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
