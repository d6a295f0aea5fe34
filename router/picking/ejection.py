"""Outlier ejection: when a failing replica stops getting requests, for how long, and how it comes back.

The rules are `EjectionPolicy`; each replica's state is a `ReplicaHealth` the
picker keeps on its `Endpoint` and changes on the router's event loop.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

log = logging.getLogger("router.picking.picker")


class Failure(enum.Enum):
    """How a request to a replica failed before its response began, as the proxy reports it."""

    CONNECT = "connect"  # no connection: refused, unreachable, connect timeout
    LOST = "lost"  # connected, then reset or closed, or silent past the read deadline
    ERROR = "error"  # the engine answered 5xx


@dataclass(frozen=True)
class EjectionPolicy:
    """When a failing replica stops getting requests, and for how long.

    A failed connect ejects at once (`connect_failures`): nothing accepted the
    connection, so no engine is serving there — the engine or its node is
    gone — and each further request sent there pays a connect attempt (up to
    the whole connect timeout for a dead host) before its retry. The cost of
    being wrong is one replica out for `first_cooldown`. Anything else ejects
    after `failures` in a row: a reset or closed connection can be the race
    with an engine closing an idle keep-alive connection, and a 5xx can be one
    bad request, so one alone says little.

    The cool-down doubles with each ejection not separated by a success, up to
    `max_cooldown`. When it ends the replica is half-open: the next pick sends
    it exactly one request, whose success brings it back (failures and
    cool-down reset) and whose failure ejects it again for the next cool-down.
    Outcomes of requests sent before an ejection and reported during its
    cool-down change nothing. The last replica of a model that is not ejected
    is never ejected, so a model always has somewhere to go.
    """

    connect_failures: int = 1
    failures: int = 3
    first_cooldown: float = 1.0
    max_cooldown: float = 30.0

    def __post_init__(self) -> None:
        if self.connect_failures < 1 or self.failures < 1:
            raise ValueError("connect_failures and failures must be >= 1")
        if not 0 < self.first_cooldown <= self.max_cooldown:
            raise ValueError("cool-downs must satisfy 0 < first_cooldown <= max_cooldown")

    def threshold(self, failure: Failure) -> int:
        """Consecutive failures that eject when the last of them is `failure`."""
        return self.connect_failures if failure is Failure.CONNECT else self.failures

    def cooldown(self, ejections: int) -> float:
        """The cool-down of the `ejections`-th ejection in a row (1, 2, 3 …)."""
        if ejections > 32:  # past any sane cap; keeps the power finite
            return self.max_cooldown
        return min(self.max_cooldown, self.first_cooldown * 2.0 ** (ejections - 1))


class ReplicaHealth:
    """A replica's recent failures and ejection, as this router saw them (times on the ejection clock)."""

    __slots__ = ("failures", "ejections", "ejected_at", "ejected_until", "probing")

    def __init__(self) -> None:
        self.failures = 0  # consecutive failures since the last success
        self.ejections = 0  # ejections since the last success; sets the next cool-down
        self.ejected_at = 0.0
        self.ejected_until = 0.0  # end of the cool-down; 0.0 when not ejected
        self.probing = False  # the half-open replica's one request is in flight

    def record_failure(self, policy: EjectionPolicy, failure: Failure, now: float, last_standing: bool) -> str:
        """Count one failure; return what changed: "ejected", "probe failed", "kept" (the last replica
        standing is never ejected; said once, then rarely) or ""."""
        if self.ejected_until:
            if now < self.ejected_until:
                return ""  # a request sent before the ejection: the cool-down stands
            # Half-open, and the probe failed: out again, for longer.
            self.probing = False
            self.eject(policy, now)
            return "probe failed"
        self.failures += 1
        threshold = policy.threshold(failure)
        if self.failures < threshold:
            return ""
        if not last_standing:
            self.eject(policy, now)
            return "ejected"
        return "kept" if self.failures == threshold or self.failures % 100 == 0 else ""

    def eject(self, policy: EjectionPolicy, now: float) -> None:
        self.ejections += 1
        self.ejected_at = now
        self.ejected_until = now + policy.cooldown(self.ejections)

    def record_success(self, now: float) -> bool:
        """An answer below 500: the failure streak ends. Returns whether an ejected replica came back
        (an answer to a request sent before the ejection changes nothing)."""
        if self.ejected_until and now < self.ejected_until:
            return False
        recovered = bool(self.ejected_until)
        self.failures = self.ejections = 0
        self.ejected_until = 0.0
        self.probing = False
        return recovered


def log_change(replica_id: str, model: str, health: ReplicaHealth, policy: EjectionPolicy, change: str) -> None:
    """Say what `record_failure` changed."""
    if change == "ejected":
        log.warning(
            "ejected replica %s of %s after %d consecutive failures, for %g s",
            replica_id,
            model,
            health.failures,
            policy.cooldown(health.ejections),
        )
    elif change == "probe failed":
        log.warning(
            "replica %s of %s failed its probe: ejected again, for %g s (ejection %d in a row)",
            replica_id,
            model,
            policy.cooldown(health.ejections),
            health.ejections,
        )
    elif change == "kept":
        log.warning(
            "replica %s of %s keeps failing (%d in a row) but is the last one not ejected",
            replica_id,
            model,
            health.failures,
        )
