"""The picker: which ready replica takes a request, how it gives it back, and which replicas are kept away.

Everything here is synchronous and cheap: it runs on the router's event loop
for every request, and only there, so it takes no lock: the loop runs one
method at a time to its end. The choice and the ledger's last-use stamp
(router.accounting.ledger) are one step of the loop (DESIGN invariant 4), so
a stamp always names the replica actually used.

Outlier ejection (router.picking.ejection) keeps requests away from a replica
that keeps failing, in the picker's own structures: the proxy reports how
each attempt ended, a success on a healthy replica costs two attribute reads,
and the clock is read only when a replica is ejected.

The engines' own load (router.picking.engine_load polls it off the request
path) is cached on each endpoint: its waiting requests add to the load, and a
replica whose KV cache is nearly full is passed over while another is not. A
request may carry its prompt's Prefix (router.picking.affinity): it prefers
the replica its longest remembered prefix was last sent to, else its
conversation key's (rendezvous hashing over the candidates), while that
replica's load stays within a slack of the least loaded, so the engine
reuses the prefix's KV cache. A key's pools, when given, restrict the
candidates. A LoRA adapter is picked like a model among the ready replicas
of its base that hold it (the same Endpoint objects, so their loads are shared).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from router.accounting.ledger import Ledger
from router.endpoints.routes import RouteTable
from router.endpoints.table import Endpoint
from router.picking.affinity import Prefix, PrefixMemory
from router.picking.choice import cached_at, least_loaded
from router.picking.ejection import EjectionPolicy, Failure, log_change

log = logging.getLogger(__name__)


class Picker:
    """Picks a replica per request from the route table, takes it back, and ejects replicas that keep failing.

    `ejection_clock` (monotonic) times cool-downs, so a step of the wall clock
    cannot strand a replica. Only the router's event loop calls it (no method
    awaits, so none is interleaved with another): it has no lock.
    """

    def __init__(
        self,
        routes: RouteTable,
        ledger: Ledger,
        *,
        ejection_clock: Callable[[], float] = time.monotonic,
        ejection: EjectionPolicy | None = None,
        kv_full_fraction: float = 0.95,
        affinity_slack: float = 4.0,
    ) -> None:
        if kv_full_fraction <= 0 or affinity_slack < 0:
            raise ValueError("kv_full_fraction must be > 0 and affinity_slack >= 0")
        self.routes = routes
        self.ledger = ledger
        self.kv_full_fraction = kv_full_fraction
        self.affinity_slack = affinity_slack
        self.prefixes = PrefixMemory()
        self._ejection_clock = ejection_clock
        self.ejection = ejection or EjectionPolicy()
        self._ejections: dict[str, int] = {}  # public name -> ejections so far (a counter, never reset)
        self._turn: dict[str, int] = {}  # round-robin position per model, for ties
        self._prefixes_for = 0  # the route table's generation `prefixes` was last pruned for
        # Told, with the public name, when a request on a replica with a capacity ends: room for the model's queue
        # (router.forwarding.admission). None: no queue.
        self.freed: Callable[[str], None] | None = None

    def pick(
        self,
        model: str,
        exclude: Iterable[Endpoint] = (),
        affinity: Prefix | None = None,
        pools: frozenset[str] | None = None,
    ) -> Endpoint | None:
        """Choose a replica of `model` and count a request against it; None if it has none.

        Candidates: the replicas not in `exclude` and, when `pools` is given,
        in one of those pools. Among them: highest priority first, then least
        load (outstanding requests plus the engine's waiting ones, per unit of
        weight), ties taken in turn, among the replicas not ejected (a
        half-open one is taken for its single probe) and not KV-full (unless
        all are: then among those). With an `affinity` prefix, the replica of
        its longest remembered prefix, else its key's (rendezvous hashing over
        that same set), is taken instead while its load is within
        `affinity_slack` of the least; where it went is remembered. When every replica left
        is ejected, the one ejected longest ago. The choice and its last-use
        stamp are one step of the loop.
        """
        candidates = self.routes.by_model.get(model)
        if not candidates:
            return None
        if exclude or pools is not None:
            # By identity: a replica placed again keeps its id but is a new endpoint (a new URL).
            excluded = set(exclude)
            candidates = [e for e in candidates if e not in excluded and (pools is None or e.pool in pools)]
            if not candidates:
                return None
        if len(candidates) == 1 and not candidates[0].health.ejected_until:
            chosen = candidates[0]  # what the rules choose when there is no choice (a model's usual case)
        else:
            chosen = self._choose(model, candidates, affinity)
        chosen.outstanding += 1
        self.ledger.picked(chosen, model)
        return chosen

    def _choose(self, model: str, candidates: list[Endpoint], affinity: Prefix | None) -> Endpoint:
        """The replica `pick` takes among `candidates` (see there)."""
        best, best_load, tier = least_loaded(candidates, True, affinity is not None, self._ejection_clock)
        if not best:  # every replica left is KV-full (or ejected): the least loaded of them
            best, best_load, tier = least_loaded(candidates, False, affinity is not None, self._ejection_clock)
        if not best:
            return min(candidates, key=lambda e: e.health.ejected_at)
        chosen = None
        if tier and affinity is not None:
            preferred = cached_at(self.prefixes, model, tier, affinity)
            if preferred.load <= best_load + self.affinity_slack:
                chosen = preferred
        if chosen is None:
            turn = self._turn.get(model, 0)
            chosen = best[turn % len(best)]
            self._turn[model] = turn + 1
        if chosen.health.ejected_until:
            chosen.health.probing = True  # half-open: this request is the one probe
        if affinity is not None:
            if self._prefixes_for != self.routes.generation:  # forget the models a new table no longer serves
                self.prefixes.keep_only(self.routes.by_model)
                self._prefixes_for = self.routes.generation
            self.prefixes.remember(model, affinity, chosen.replica_id)
        return chosen

    def record_engine_load(self, endpoint: Endpoint, waiting: float | None, kv_usage: float | None) -> None:
        """Cache what the engine behind `endpoint` reported (None: unknown), for the picks to come."""
        endpoint.engine_waiting = waiting
        endpoint.kv_usage = kv_usage
        endpoint.queued = waiting or 0.0
        endpoint.kv_full = kv_usage is not None and kv_usage >= self.kv_full_fraction

    def release(self, endpoint: Endpoint, failure: Failure | None = None, model: str | None = None) -> None:
        """The request counted by `pick` has finished (in any way); `failure` if it failed before its response.

        `model`: the public name it was picked for (pick's `model`), needed when that is an adapter's.
        """
        endpoint.outstanding -= 1
        self.ledger.released(endpoint, model)
        if endpoint.capacity and self.freed is not None:
            self.freed(model or endpoint.model)
        if failure is None:
            # A probe that ended without an outcome (the client left): let another request probe.
            endpoint.health.probing = False
            return
        self.failed(endpoint, failure)

    def failed(self, endpoint: Endpoint, failure: Failure) -> None:
        """A request on `endpoint` failed: count it (a 5xx relayed to the client as it is, or a failed attempt)."""
        others = self.routes.by_model.get(endpoint.model, ())
        last_standing = all(other is endpoint or other.health.ejected_until for other in others)
        change = endpoint.health.record_failure(self.ejection, failure, self._ejection_clock(), last_standing)
        if change in ("ejected", "probe failed"):
            self._ejections[endpoint.model] = self._ejections.get(endpoint.model, 0) + 1
        if change:
            log_change(endpoint.replica_id, endpoint.model, endpoint.health, self.ejection, change)

    def succeeded(self, endpoint: Endpoint) -> None:
        """`endpoint` answered a request (below 500): its failure streak ends; a half-open one is back."""
        health = endpoint.health
        if not (health.failures or health.ejected_until):
            return  # the hot path: a healthy replica stays healthy at the cost of two reads
        recovered = health.record_success(self._ejection_clock())
        if recovered:
            log.info("replica %s of %s answered its probe and is back", endpoint.replica_id, endpoint.model)

    # -- outlier ejection, for metrics and /health --------------------------------------
    def ejected(self) -> list[Endpoint]:
        """The replicas ejected now (cooling down, or half-open awaiting their probe)."""
        return [e for e in self.routes.by_replica.values() if e.health.ejected_until]

    def ejection_counts(self) -> dict[str, int]:
        """Ejections so far per public model name (a counter: never reset, not even by a new table)."""
        return dict(self._ejections)
