"""Requests of one model waiting for capacity in a router, and the order they leave in: priority class first, then
each tenant's fair share of the tokens served (weighted), then arrival.

A tenant is a team (a key of no team is a tenant of its own). Fairness is counted in tokens, not requests, so a
tenant whose answers are long gets fewer of them: each tenant has a virtual time, the tokens it was served divided
by its weight, and the next request to leave is the oldest of the tenant whose virtual time is least, among those
waiting in the best class. A request's tokens are known only when its answer ends: it is charged an estimate when
it leaves the queue (so a burst does not all leave before the first answer ends) and the difference when it ends
(`served`). A tenant that had nothing waiting starts again at the virtual time of the last request to leave, not at
its own old one: being idle earns no credit to spend later in a burst (start-time fair queuing).

Each tenant may keep `max_waiting` requests waiting (past that `push` raises QueueFull, with a Retry-After from the
queue's pace), each for `max_wait_seconds` at most (`expire` hands back those past it). Nothing here does I/O or
awaits: the caller owns the waiting (a future per request) and calls `pop` when capacity frees.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_ESTIMATE = 256
"""Tokens a request is charged when it leaves while its tenant has no answer measured yet."""
Eligible = Callable[[str, int], bool]
"""Whether a tenant's requests of a class may leave the queue now."""
ESTIMATE_WEIGHT = 0.1
"""How much each measured answer moves its tenant's estimate (an exponential average)."""


class QueueFull(Exception):
    """A tenant already has `max_waiting` requests waiting for this model."""

    def __init__(self, tenant: str, waiting: int, retry_after: float) -> None:
        super().__init__(f"{waiting} requests of {tenant} are already waiting for this model")
        self.tenant, self.waiting, self.retry_after = tenant, waiting, retry_after


@dataclass(eq=False)
class Waiting:
    """One request in the queue: its tenant, class (0 first), when it arrived and until when it may wait."""

    item: Any
    tenant: str
    priority: int
    arrived: float
    deadline: float
    charged: float = 0.0
    """The tokens it was charged when it left (its tenant's estimate then), corrected by `served`."""
    queued: bool = True
    """False once it left the queue: handed out, taken out or expired (a taken-out one stays in its deque until it
    reaches the front, so taking one out costs no search)."""


@dataclass
class _Tenant:
    weight: float
    virtual: float = 0.0
    estimate: float = DEFAULT_ESTIMATE
    waiting: dict[int, deque[Waiting]] = field(default_factory=dict)  # class -> its requests, oldest first
    size: int = 0  # those still queued

    def count(self) -> int:
        return self.size


class FairQueue:
    """One model's waiting requests in one router (see the module docstring). Used on the router's event loop only."""

    def __init__(
        self, *, max_waiting: int, max_wait_seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_waiting = max_waiting
        self.max_wait_seconds = max_wait_seconds
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}
        self._virtual = 0.0  # the virtual time of the last request to leave
        self._size = 0
        self._by_class: dict[int, int] = {}  # class -> requests of it waiting
        self._left: deque[float] = deque(maxlen=64)  # when the last requests left: the queue's pace

    def __len__(self) -> int:
        return self._size

    def waiting(self, tenant: str) -> int:
        """How many of `tenant`'s requests wait."""
        state = self._tenants.get(tenant)
        return 0 if state is None else state.count()

    def push(self, item: Any, tenant: str, priority: int = 0, weight: float = 1.0) -> Waiting:
        """Queue `item` for `tenant` in class `priority` (0 leaves first); QueueFull past the tenant's bound."""
        if not weight > 0 or math.isinf(weight):
            raise ValueError(f"a tenant's weight must be a positive number, got {weight!r}")
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(weight, virtual=self._virtual)
        waiting = state.count()
        if waiting >= self.max_waiting:
            raise QueueFull(tenant, waiting, self.retry_after(waiting))
        if not waiting:
            state.virtual = max(state.virtual, self._virtual)  # idle time earns no credit
        state.weight = weight
        now = self._clock()
        entry = Waiting(item, tenant, priority, now, now + self.max_wait_seconds)
        state.waiting.setdefault(priority, deque()).append(entry)
        state.size += 1
        self._size += 1
        self._by_class[priority] = self._by_class.get(priority, 0) + 1
        return entry

    def _next(self, eligible: Eligible | None) -> tuple[_Tenant, int] | None:
        """The tenant and class of the next request to leave, among those `eligible` says may (all if None);
        None if none waits."""
        best: tuple[int, float, float] | None = None
        chosen: _Tenant | None = None
        for name, state in self._tenants.items():
            for priority, queue in state.waiting.items():
                while queue and not queue[0].queued:
                    queue.popleft()  # taken out while it waited
                if queue and (eligible is None or eligible(name, priority)):
                    rank = (priority, state.virtual, queue[0].arrived)
                    if best is None or rank < best:
                        best, chosen = rank, state
        return None if chosen is None or best is None else (chosen, best[0])

    def peek(self, eligible: Eligible | None = None) -> Waiting | None:
        """The request `pop(eligible)` would hand out now, left in the queue; None if none waits."""
        found = self._next(eligible)
        return None if found is None else found[0].waiting[found[1]][0]

    def pop(self, eligible: Eligible | None = None) -> Waiting | None:
        """The next request to leave (see the module docstring), charged its tenant's estimate; None if none waits.
        `eligible(tenant, class)`: whether that tenant's requests of that class may leave now (None: all may)."""
        found = self._next(eligible)
        if found is None:
            return None
        chosen, priority = found
        entry = chosen.waiting[priority].popleft()
        self._left_queue(chosen, entry)
        self._virtual = chosen.virtual
        entry.charged = chosen.estimate
        chosen.virtual += entry.charged / chosen.weight
        self._left.append(self._clock())
        return entry

    def by_class(self) -> dict[int, int]:
        """Class -> requests of it waiting (classes with none left out)."""
        return {rank: count for rank, count in self._by_class.items() if count}

    def _left_queue(self, state: _Tenant, entry: Waiting) -> None:
        entry.queued = False
        state.size -= 1
        self._size -= 1
        self._by_class[entry.priority] -= 1

    def served(self, entry: Waiting, tokens: int) -> None:
        """The answer of a request that left has ended, with `tokens` (prompt and completion): its tenant is
        charged the difference from what it was charged when it left, and its estimate learns."""
        state = self._tenants.get(entry.tenant)
        if state is None:
            return
        state.virtual += (tokens - entry.charged) / state.weight
        entry.charged = tokens
        state.estimate += ESTIMATE_WEIGHT * (tokens - state.estimate)

    def remove(self, entry: Waiting) -> bool:
        """Take `entry` out (its client left); False if it had already left."""
        state = self._tenants.get(entry.tenant)
        if state is None or not entry.queued:
            return False
        self._left_queue(state, entry)
        return True

    def expire(self) -> list[Waiting]:
        """Take out and return the requests waiting past their deadline, then `forget_idle`."""
        now, gone = self._clock(), []
        for state in self._tenants.values():
            for queue in state.waiting.values():
                while queue and (not queue[0].queued or queue[0].deadline <= now):
                    entry = queue.popleft()
                    if entry.queued:
                        self._left_queue(state, entry)
                        gone.append(entry)
        self.forget_idle()
        return gone

    def forget_idle(self) -> None:
        """Forget the tenants with nothing waiting and no credit left to keep (their virtual time is behind the
        queue's: they would start from the queue's anyway), so keys that come and go leave nothing behind."""
        for name in [
            name for name, state in self._tenants.items() if not state.size and state.virtual <= self._virtual
        ]:
            del self._tenants[name]

    def retry_after(self, waiting: int) -> float:
        """Seconds until `waiting` requests would have left at the pace the last ones left (at least 1)."""
        left = self._left
        if len(left) < 2 or left[-1] <= left[0]:
            return 1.0
        pace = (left[-1] - left[0]) / (len(left) - 1)
        return max(1.0, waiting * pace)
