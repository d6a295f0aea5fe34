"""The hub: everything that crosses between the control plane and the routers.

A plain package (no Django models), at the bottom of the dependency stack: the
reconciler publishes and collects through it, the router reads and records
through it, and neither imports the other. `contracts` says what crosses;
`memory.InProcessHub` (embedded) and `redis_hub.RedisHub` (distributed)
carry it. `get_hub()` returns the process-wide one for the configured mode.
"""

from __future__ import annotations

import threading

from django.conf import settings

from hub.contracts import ControlPlaneHub, EndpointTable, RouterHub, UsageReport
from hub.fingerprint import fingerprint
from hub.memory import InProcessHub
from hub.redis_hub import RedisHub

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


def get_hub() -> InProcessHub | RedisHub:
    """The process-wide hub: Redis when settings.REDIS_URL is set, else in-process."""
    global _hub
    with _hub_lock:
        if _hub is None:
            _hub = RedisHub(settings.REDIS_URL) if settings.REDIS_URL else InProcessHub()
        return _hub


def reset_hub() -> None:
    """Forget the process-wide hub (tests switch modes)."""
    global _hub
    with _hub_lock:
        _hub = None
