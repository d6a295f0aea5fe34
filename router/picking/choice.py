"""Which of a model's replicas a request may go to (router.picking.picker picks among them): the least loaded at the
top priority, and the one holding the KV cache of the request's prompt prefix (router.picking.affinity)."""

from __future__ import annotations

from collections.abc import Callable

from router.endpoints.table import Endpoint
from router.picking.affinity import Prefix, PrefixMemory

_INFINITY = float("inf")


def least_loaded(
    candidates: list[Endpoint], skip_full: bool, with_tier: bool, ejection_clock: Callable[[], float]
) -> tuple[list[Endpoint], float, list[Endpoint] | None]:
    """(least loaded at the top priority, their load, every one at the top priority if `with_tier`).

    Ejected replicas (but a half-open one due its probe) are left out, and
    KV-full ones if `skip_full`. The ejection clock is read only if some replica is ejected.
    """
    now: float | None = None
    best: list[Endpoint] = []
    tier: list[Endpoint] | None = [] if with_tier else None
    top = 0
    best_load = _INFINITY
    for e in candidates:
        health = e.health
        if health.ejected_until:
            if now is None:
                now = ejection_clock()
            if health.probing or now < health.ejected_until:
                continue
        if skip_full and e.kv_full:
            continue
        priority = e.priority
        if not best or priority > top:
            best, top, best_load = [e], priority, e.load
            if tier is not None:
                tier = [e]
        elif priority == top:
            if tier is not None:
                tier.append(e)
            load = e.load
            if load < best_load:
                best, best_load = [e], load
            elif load == best_load:
                best.append(e)
    return best, best_load, tier


def cached_at(memory: PrefixMemory, model: str, tier: list[Endpoint], prefix: Prefix) -> Endpoint:
    """Where `prefix`'s KV cache is among `tier`: the replica its longest remembered prefix was last sent to,
    else its conversation key's by rendezvous hashing (the same on every router)."""
    if len(tier) == 1:
        return tier[0]
    last = memory.last_replica(model, prefix)
    if last is not None:
        for endpoint in tier:
            if endpoint.replica_id == last:
                return endpoint
    key = prefix.key
    return max(tier, key=lambda e: rendezvous_weight(key, e.affinity_seed))


_MASK = (1 << 64) - 1


def rendezvous_weight(key: int, seed: int) -> int:
    """A well-mixed 64-bit weight of (key, replica seed), splitmix64's finalizer: the replica with the largest
    takes the key. (A tuple's hash() mixes small ints too little: 24 keys split 16/7/1 over three replicas.)"""
    x = (key * 0x9E3779B97F4A7C15 + seed) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)
