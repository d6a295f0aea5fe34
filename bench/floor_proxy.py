"""The floor: the least a Python proxy in front of an engine can do, as a raw ASGI app on aiohttp.

    python bench/floor_proxy.py PORT UPSTREAM

No keys, no balancing, no accounting, no error shaping: it forwards the body
to one upstream and streams the answer back. `router_bench.py` runs it under
the same server as the router (uvicorn, uvloop, httptools), so the difference
between the two is what llmgw's features cost.
"""

from __future__ import annotations

import sys

import aiohttp
import uvicorn

UPSTREAM = sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:9000"
HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host"}
_session: aiohttp.ClientSession | None = None


async def app(scope, receive, send):
    global _session
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                _session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await _session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    headers = {k.decode(): v.decode() for k, v in scope["headers"] if k not in HOP_BY_HOP}
    async with _session.request(scope["method"], UPSTREAM + scope["path"], data=body, headers=headers) as upstream:
        out = [
            (k.lower().encode(), v.encode())
            for k, v in upstream.headers.items()
            if k.lower().encode() not in HOP_BY_HOP
        ]
        await send({"type": "http.response.start", "status": upstream.status, "headers": out})
        async for chunk in upstream.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


if __name__ == "__main__":
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        proxy_headers=False,
    )
