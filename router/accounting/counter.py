"""Requests, tokens and spend counted in memory per key and model, tokens per replica and key, and last use per key,
between usage flushes.

router.accounting.usage_reader reads the usage of an answer; this counts it. Nothing here does I/O: the proxy counts on the
router's event loop and the usage flusher (router.accounting.flusher) takes the counts once a second (DESIGN invariant 4).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hub.contracts import ReplicaTokens, TokenCount, TokenCounts, add_replica_tokens


class TokenCounter:
    """Requests and tokens per (key digest, public model), and last use per key, since the last flush.

    Used only on the router's event loop (the proxy counts, the flusher takes),
    so it needs no lock. A key is its digest, `hub.credentials.hash_secret` of
    the bearer token: what `ApiKey.key_hash` stores.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        # digest -> model -> [requests, prompt, completion, spend]: list items, not TokenCount's attributes, which
        # cost twice as much to add to on the path of every answer (a msgspec Struct's, measured).
        self._counts: dict[str, dict[str, list[int]]] = {}
        self._last_use: dict[str, float] = {}
        self._replicas: ReplicaTokens = {}  # replica id -> digest -> tokens it served that key (the showback's)

    def count(
        self,
        digest: str,
        model: str,
        usage: tuple[int, int] | None,
        served: bool,
        prices: tuple[int, int, int] | None = None,
        replica: str | None = None,
    ) -> None:
        """One answer relayed for `digest`: its last use always, a request and its tokens if `served` (2xx), and
        what they cost at `prices` (the table's, router.endpoints.routes; None: free, or its budgets' settlement
        counts the cost); its tokens against `replica`, the one that answered."""
        self._last_use[digest] = self._clock()
        if not served:
            return
        per_key = self._counts.get(digest)
        if per_key is None:
            per_key = self._counts[digest] = {}
        row = per_key.get(model)
        if row is None:
            row = per_key[model] = [0, 0, 0, 0]
        row[0] += 1
        if usage is not None:
            row[1] += usage[0]
            row[2] += usage[1]
            if prices is not None:
                row[3] += usage[0] * prices[0] + usage[1] * prices[1]
            if replica is not None:
                per_replica = self._replicas.get(replica)
                if per_replica is None:
                    per_replica = self._replicas[replica] = {}
                per_replica[digest] = per_replica.get(digest, 0) + usage[0] + usage[1]

    def take(self) -> tuple[TokenCounts, dict[str, float]]:
        """Swap out the counts and last uses gathered since the last take."""
        counts, self._counts = self._counts, {}
        last_use, self._last_use = self._last_use, {}
        return _typed(counts), last_use

    def take_replicas(self) -> ReplicaTokens:
        """Swap out the tokens per replica and key gathered since the last take."""
        replicas, self._replicas = self._replicas, {}
        return replicas

    def restore_replicas(self, replicas: ReplicaTokens) -> None:
        """Put back tokens per replica a flush could not deliver: they add up."""
        add_replica_tokens(self._replicas, replicas)

    def restore(self, counts: TokenCounts, last_use: dict[str, float]) -> None:
        """Put back what a flush could not deliver: counts add up, the newer last use wins."""
        for digest, models in counts.items():
            per_key = self._counts.setdefault(digest, {})
            for model, count in models.items():
                row = per_key.setdefault(model, [0, 0, 0, 0])
                row[0] += count.requests
                row[1] += count.prompt
                row[2] += count.completion
                row[3] += count.spend
        for digest, ts in last_use.items():
            if ts > self._last_use.get(digest, float("-inf")):
                self._last_use[digest] = ts

    def pending(self) -> tuple[TokenCounts, dict[str, float]]:
        """A copy of what the next flush would take (for tests and /health)."""
        return _typed(self._counts), dict(self._last_use)


def _typed(counts: dict[str, dict[str, list[int]]]) -> TokenCounts:
    """The counter's rows as the hub's contract has them (new objects: later counting never changes them)."""
    return {
        digest: {
            model: TokenCount(requests=row[0], prompt=row[1], completion=row[2], spend=row[3])
            for model, row in models.items()
        }
        for digest, models in counts.items()
    }
