"""The mock engine's batch: at most `--max-num-seqs` requests run at once, the rest wait in its own queue, as vLLM's
scheduler holds them (`vllm:num_requests_waiting` counts them).

The queue is first come, first served, or with `--scheduling-policy priority` ordered by each request's `priority`
field (lower first, then arrival), as vLLM's priority scheduling admits them. Without `--max-num-seqs` nothing
waits: every request runs at once, the mock's behaviour before this existed.

With `--batch-slowdown F` each step of a request takes the token delay × (1 + F × the other requests running), as a
GPU engine's decode step grows with its batch: its inter-token gaps (and first tokens) grow with the load before
anything waits, the signal latency objectives scale on.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class MockBatch:
    """Running and waiting requests of one mock engine (see the module docstring)."""

    def __init__(self, max_num_seqs: int | None = None, by_priority: bool = False, slowdown: float = 0.0) -> None:
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if not slowdown >= 0:
            raise ValueError("slowdown must be >= 0")
        self.max_num_seqs = max_num_seqs
        self.by_priority = by_priority
        self.slowdown = slowdown
        self.running = 0
        self._queue: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def step(self, token_delay: float) -> float:
        """How long one token takes now, for a running request: longer the more others run beside it."""
        return token_delay * (1 + self.slowdown * max(0, self.running - 1))

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, future in self._queue if not future.done())

    async def enter(self, priority: int = 0) -> None:
        """Wait for a place in the batch (at once while there is one and nobody waits)."""
        if self.max_num_seqs is None or (self.running < self.max_num_seqs and not self._queue):
            self.running += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (priority if self.by_priority else 0, next(self._order), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.leave()  # its place was given as it left: hand it on
            raise

    def leave(self) -> None:
        """A running request ended: its place goes to the first waiting one."""
        while self._queue:
            _, _, future = heapq.heappop(self._queue)
            if not future.done():
                future.set_result(None)
                return
        self.running -= 1
