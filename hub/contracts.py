"""What crosses between the control plane and the routers, as typed interfaces.

The control plane (the reconcile tick) and the routers never import each
other: both depend on these protocols, and each mode supplies one object that
implements all of them (`hub.memory.InProcessHub` embedded,
`hub.redis_hub.RedisHub` distributed).

* endpoint table: the tick publishes, routers read and watch (DESIGN invariant 7);
* usage stamps: routers record last use, the tick collects (invariant 4);
* watch mark: routers say "we are recording usage", so the tick can tell
  "never used while watched" from "unknown" (invariant 3);
* activation queue: routers ask for a model to be started, the tick drains.

Control-plane methods are synchronous (they run inside the tick); router
methods are coroutines (they run on the router's loop).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol

EndpointTable = dict[str, Any]
"""{"models": {name: {"aliases": [...], "unplaceable"?: str, "start_seconds"?: float}},
"endpoints": [{"replica_id", "model", "url", "priority", "weight", "pool"}], "fingerprint": str}"""


class EndpointSink(Protocol):
    """The control plane's side of the endpoint table."""

    def publish_endpoints(self, table: EndpointTable) -> bool:
        """Publish `table` if its fingerprint changed; return whether it was published."""
        ...


class EndpointSource(Protocol):
    """The router's side of the endpoint table."""

    async def read_endpoints(self) -> EndpointTable | None: ...

    def watch_endpoints(self) -> AsyncIterator[EndpointTable]:
        """Yield each newly published table, forever."""
        ...


class UsageSink(Protocol):
    """Where routers put last-use stamps (newest wins) and renew their watch mark."""

    async def record_usage(self, stamps: dict[str, float]) -> None: ...

    async def keep_watching(self, ttl: float) -> None:
        """Renew the watching mark; a mark not renewed within `ttl` seconds has lapsed."""
        ...


class UsageSource(Protocol):
    """Where the tick reads last-use stamps and the watch mark."""

    def collect_usage(self) -> dict[str, float]: ...

    def forget_usage(self, replica_ids: Iterable[str | int]) -> None: ...

    def watching_since(self) -> float | None:
        """Since when routers have recorded usage without a gap (Unix time), or None."""
        ...


class ActivationQueue(Protocol):
    """Routers ask for models to be started; the tick takes every request once."""

    async def request_activation(self, model_name: str) -> None: ...

    def drain_activations(self) -> set[str]: ...


class ControlPlaneHub(EndpointSink, UsageSource, ActivationQueue, Protocol):
    """Everything the reconcile tick needs from the hub."""


class RouterHub(EndpointSource, UsageSink, ActivationQueue, Protocol):
    """Everything a router needs from the hub."""
