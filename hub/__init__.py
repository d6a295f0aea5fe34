"""The hub: everything that crosses between the control plane and the routers.

A plain package (no Django models), at the bottom of the dependency stack: the
reconciler publishes and collects through it, the router reads and records
through it, and neither imports the other. `contracts` says what crosses;
`memory.InProcessHub` (embedded) and `redis_hub.RedisHub` (distributed)
carry it. `get_hub()` returns the process-wide one for the configured mode.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from django.conf import settings

from .contracts import ControlPlaneHub, EndpointTable, RouterHub, UsageReport
from .fingerprint import fingerprint
from .memory import InProcessHub

if TYPE_CHECKING:
    from .redis_hub import RedisHub

__all__ = [
    "ControlPlaneHub",
    "EndpointTable",
    "InProcessHub",
    "RedisHub",
    "RouterHub",
    "UsageReport",
    "fingerprint",
    "get_hub",
    "reset_hub",
]

_hub: InProcessHub | RedisHub | None = None
_hub_lock = threading.Lock()


def _redis_hub_class() -> type[RedisHub]:
    # Imported on first use: the redis client is a sixth of a second of start-up that an embedded process,
    # or a command that never talks to the hub, would pay for nothing.
    from .redis_hub import RedisHub

    return RedisHub


def __getattr__(name: str) -> Any:
    if name == "RedisHub":
        return _redis_hub_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_hub() -> InProcessHub | RedisHub:
    """The process-wide hub: Redis when settings.REDIS_URL is set, else in-process."""
    global _hub
    with _hub_lock:
        if _hub is None:
            _hub = _redis_hub_class()(settings.REDIS_URL) if settings.REDIS_URL else InProcessHub()
        return _hub


def reset_hub() -> None:
    """Forget the process-wide hub (tests switch modes)."""
    global _hub
    with _hub_lock:
        _hub = None
