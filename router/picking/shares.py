"""Who may take a full model's free room: each class's room, and each tenant's share of it.

A model's capacity is the requests its replicas run at once (their profiles' `max_concurrency`, summed). Every
request on it is counted against its tenant (a team, or a key of no team) and class while it runs, and each
tenant's demand in a class (running and waiting) is remembered at its highest over the last minute: its recent peak.

A class's room is the whole capacity, but for batch: batch is served only from spare room, the capacity less what
the other classes need, the recent peak of each of their tenants plus one (so a demand rising past its peak finds a
slot too). Interactive and standard share the capacity, and the queue hands free room to interactive first. Within
a class, a tenant may start one more request while it runs fewer than its limit:

    limit = max(room × weight / (sum of the weights of the class's tenants seen in the last minute),
                room − the class's other tenants' recent peaks, each plus one)

So a tenant alone may use all of its class's room; a tenant flooding a shared model leaves free the room the
others' recent peaks needed, so a light tenant's request finds a slot rather than waiting for one of the flood's
answers to end; tenants that all saturate it split it by weight. As each running sequence decodes at the engine's
pace, a share of the running requests is a share of the tokens served; the fair queue (router.picking.fair_queue)
orders the waiting by tokens too. Room left for a peak that does not come back is given up within a minute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hub.priority import BATCH

PEAK_SECONDS = 60.0
"""How long a peak of demand is remembered (two half-window buckets: between 30 and 60 s)."""
HEADROOM = 1
"""Requests beyond each other tenant's recent peak left free for it: its demand rising past its peak by one finds a
slot too."""


@dataclass(slots=True)
class Use:
    """One tenant's requests of one class on a model: running, waiting, and its recent peak."""

    priority: int
    weight: int = 1
    running: int = 0
    waiting: int = 0
    peak: int = 0  # the most running and waiting at once in this half-window
    previous: int = 0  # and in the last one

    def recent_peak(self) -> int:
        return max(self.peak, self.previous)

    def saw(self) -> None:
        demand = self.running + self.waiting
        if demand > self.peak:
            self.peak = demand

    def idle(self) -> bool:
        return not (self.running or self.waiting or self.peak or self.previous)

    def needs(self) -> int:
        """The room kept for it: its recent peak and one more, none if it had none."""
        peak = self.recent_peak()
        return peak + HEADROOM if peak else 0


@dataclass
class ModelShares:
    """What runs and waits on one model, by tenant and class (see the module docstring)."""

    tenants: dict[tuple[str, int], Use] = field(default_factory=dict)
    bucket_at: float = float("-inf")  # when the current half-window began

    def tenant(self, name: str, priority: int, weight: int) -> Use:
        use = self.tenants.get((name, priority))
        if use is None:
            use = self.tenants[name, priority] = Use(priority, weight)
        else:
            use.weight = weight
        return use

    def limit(self, tenant: Use, capacity: int) -> float:
        """How many requests `tenant` may run on a model of `capacity`."""
        return self.limits(capacity)(tenant)

    def limits(self, capacity: int) -> Callable[[Use], float]:
        """`limit` for every tenant of the model as it is now, the sums over tenants taken once (the queue asks
        for many tenants at each hand-out)."""
        weights: dict[int, int] = {}  # class -> its tenants' weights
        needs: dict[int, int] = {}  # class -> its tenants' needs
        for use in self.tenants.values():
            weights[use.priority] = weights.get(use.priority, 0) + use.weight
            needs[use.priority] = needs.get(use.priority, 0) + use.needs()
        above_batch = sum(need for priority, need in needs.items() if priority < BATCH)

        def limit(tenant: Use) -> float:
            priority = tenant.priority  # a tenant of the model (`tenant()`): counted in the sums
            room = capacity - above_batch if priority >= BATCH else capacity
            others = needs.get(priority, 0) - tenant.needs()
            return max(room * tenant.weight / max(weights.get(priority, 0), 1), room - others)

        return limit

    def rotate(self, now: float) -> None:
        """Start a new half-window when the current one is over, forgetting peaks older than the window and the
        tenants with nothing left to remember."""
        if now - self.bucket_at < PEAK_SECONDS / 2:
            return
        fresh = now - self.bucket_at < PEAK_SECONDS
        for use in self.tenants.values():
            use.previous = use.peak if fresh else 0
            use.peak = use.running + use.waiting
        self.bucket_at = now
        for key in [key for key, use in self.tenants.items() if use.idle()]:
            del self.tenants[key]
