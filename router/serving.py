"""Serving a router app under uvicorn, with a graceful stop.

On SIGTERM (or SIGINT) the router stops taking requests and lets those in
flight finish, for at most `grace` seconds (LLMGW_SHUTDOWN_GRACE_SECONDS),
then exits:

* the listening socket is closed at once (uvicorn), so new connections go to
  the other routers behind the load balancer;
* a request that still reaches this router on a kept-alive connection gets
  503 `shutting_down` with `Connection: close` (RouterState.draining), and
  /health answers 503 so balancers take the router out;
* streams in flight run to their end; past the grace period uvicorn cancels
  them, which closes their upstream connections (the engines stop
  generating), and the lifespan shutdown flushes the last usage.

`GracefulServer` is the uvicorn.Server to run any router app with (the
`python -m router.asgi` entry point, `manage.py router`, embedded mode);
`server_options` is the one configuration the router is served with (the
entry point, the command with one worker or several, the benches).
"""

from __future__ import annotations

from types import FrameType
from typing import Any

import uvicorn


def server_options(grace: float) -> dict[str, Any]:
    """uvicorn's options for the router, wherever it is served: uvloop + httptools, lifespan on, `grace`
    seconds to drain, and no per-request work the router does not need."""
    return {
        "loop": "uvloop",
        "http": "httptools",
        "lifespan": "on",
        # The router reads no client address, so the proxy-headers middleware is pure cost; the access
        # log costs per request too (docs/benchmarks.md), and warnings are all the router logs by default.
        "proxy_headers": False,
        "access_log": False,
        "log_level": "warning",
        "timeout_graceful_shutdown": grace,
    }


def server_config(app: Any, *, host: str = "127.0.0.1", port: int = 8080, grace: float) -> uvicorn.Config:
    """uvicorn's configuration for one router process serving `app` (server_options)."""
    return uvicorn.Config(app, host=host, port=port, **server_options(grace))


class GracefulServer(uvicorn.Server):
    """A uvicorn server that tells the router app to drain as soon as it is asked to stop."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.begin_drain()
        super().handle_exit(sig, frame)

    def begin_drain(self) -> None:
        """Refuse new requests from now on; uvicorn then closes the listener and waits for the rest."""
        state = getattr(self.config.app, "state", None)
        if state is not None:
            state.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        should_exit = await super().on_tick(counter)
        if should_exit:
            # Also when an embedding process sets should_exit rather than a signal arriving.
            self.begin_drain()
        return should_exit
