"""The router's view of the endpoint table: name resolution, replica choice, outlier ejection and last-use stamps.

Everything here is synchronous and cheap: it runs on the router's event loop
for every request, and only there, so it takes no lock: the loop runs one
method at a time to its end. Choosing a replica and stamping its last use are
one step of the loop (DESIGN invariant 4), so recording use costs a dict write
per request and nothing else; counting the model's requests in flight and
their peak (for scale-out on load) is two more dict updates in the same step.

Outlier ejection (router.picking.ejection) keeps requests away from a replica that
keeps failing, in the balancer's own structures: the proxy reports how each
attempt ended, a success on a healthy replica costs two attribute reads, and
the clock is read only when a replica is ejected.

The engines' own load (router.picking.engine_load polls it off the request path) is
cached on each endpoint: its waiting requests add to the load, and a replica
whose KV cache is nearly full is passed over while another is not. A request
may carry its prompt's Prefix (router.picking.affinity): it prefers the replica its
longest remembered prefix was last sent to, else its conversation key's
(rendezvous hashing over the candidates), while that replica's load stays
within a slack of the least loaded, so the engine reuses the prefix's KV
cache. A key's pools, when given, restrict the candidates.

A LoRA adapter is picked like a model among the ready replicas of its base
that hold it (the same Endpoint objects, so their loads are shared): the pick
stamps the replica and `"<replica>/<adapter>"`, and counts the request in
flight under the base, whose scale-out carries its adapters' load, and under
the adapter, which the leader spreads over more replicas when busy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from hub.contracts import ADAPTER_STAMP_SEPARATOR, AdapterEntry, EndpointTable
from router.accounting.counter import TokenCounter
from router.accounting.limits import RateLimiter
from router.endpoints.table import Endpoint, adapter_holders, endpoint_of, model_lookups
from router.picking.affinity import Prefix, PrefixMemory
from router.picking.choice import cached_at, least_loaded
from router.picking.ejection import EjectionPolicy, Failure, log_change

log = logging.getLogger(__name__)

# Why a request for an adapter is held while a running replica of its base is to load it (a hold's reason label).
ADAPTER_LOAD = "adapter_load"


class Balancer:
    """Resolves public names and aliases, picks a replica per request, ejects failing ones, and keeps last-use stamps.

    `clock` (wall time) stamps last use; `ejection_clock` (monotonic) times
    cool-downs, so a step of the wall clock cannot strand a replica. Only the
    router's event loop calls it (no method awaits, so none is interleaved
    with another): it has no lock.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        *,
        ejection_clock: Callable[[], float] = time.monotonic,
        ejection: EjectionPolicy | None = None,
        kv_full_fraction: float = 0.95,
        affinity_slack: float = 4.0,
    ) -> None:
        if kv_full_fraction <= 0 or affinity_slack < 0:
            raise ValueError("kv_full_fraction must be > 0 and affinity_slack >= 0")
        self.kv_full_fraction = kv_full_fraction
        self.affinity_slack = affinity_slack
        self.prefixes = PrefixMemory()
        self._clock = clock
        self._ejection_clock = ejection_clock
        self.ejection = ejection or EjectionPolicy()
        self._ejections: dict[str, int] = {}  # public name -> ejections so far (a counter, never reset)
        self._names: dict[str, str] = {}  # public name or alias -> public name
        self._catalog: dict[str, list[str]] = {}  # public name -> aliases
        self._unplaceable: dict[str, tuple[str, frozenset[str]]] = {}  # public name -> why it cannot be placed now
        self._start_failed: dict[str, str] = {}  # public name -> why its only replica failed
        self._start_seconds: dict[str, float] = {}  # public name -> learned time from placement to ready
        self._holding: dict[str, str] = {}  # public name -> why its requests are held, when not a start
        self._pools: dict[str, frozenset[str]] = {}  # public name -> its profiles' pools, when published
        self._adapters: dict[str, AdapterEntry] = {}  # public adapter name -> its entry
        self._endpoints: dict[str, list[Endpoint]] = {}  # public name -> ready replicas (an adapter's: holding it)
        self._by_replica: dict[str, Endpoint] = {}
        self._turn: dict[str, int] = {}  # round-robin position per model, for ties
        self._stamps: dict[str, float] = {}  # replica id (or "<replica>/<adapter>") -> last use, not yet flushed
        self._adapter_busy: dict[str, int] = {}  # "<replica>/<adapter>" -> its requests in flight (none: left out)
        self._in_flight: dict[str, int] = {}  # public name -> requests picked and not yet released
        self._peaks: dict[str, int] = {}  # public name -> most in flight at once since the last take
        self.fingerprint: str | None = None
        self.generation = 0  # tables installed so far: what was derived from one table is stale after it
        # Requests and tokens per key and model: kept here, beside the stamps, because the usage flusher
        # takes both together (router.accounting.usage_reader); the proxy counts into it when an answer ends.
        self.tokens = TokenCounter(clock)
        # Limited keys' allowances: the app admits from them, the proxy adds tokens, the flusher syncs them.
        self.limits = RateLimiter(clock)

    # -- the table --------------------------------------------------------------
    def apply_table(self, table: EndpointTable) -> bool:
        """Install a published table (router.endpoints.table decoded it); return False when it is the one already installed."""
        fingerprint = table.fingerprint or None
        if fingerprint is not None and fingerprint == self.fingerprint:
            return False
        lookups = model_lookups(table.models, table.adapters)
        catalog = lookups.catalog

        endpoints: dict[str, list[Endpoint]] = {}
        by_replica: dict[str, Endpoint] = {}
        for row in table.endpoints:
            fresh = endpoint_of(row)
            if fresh.model not in catalog:
                continue
            current = self._by_replica.get(fresh.replica_id)
            if current is not None and current.url == fresh.url and current.model == fresh.model:
                # Keep the same object so requests in flight still count against it.
                current.priority, current.weight, current.pool = fresh.priority, fresh.weight, fresh.pool
                current.authorization = fresh.authorization
                fresh = current
            by_replica[fresh.replica_id] = fresh
            endpoints.setdefault(fresh.model, []).append(fresh)
        endpoints.update(adapter_holders(lookups.adapters, by_replica))  # names of models and adapters never clash
        self._adapters = lookups.adapters
        self._names, self._catalog, self._unplaceable = lookups.names, catalog, lookups.unplaceable
        self._start_seconds, self._start_failed = lookups.start_seconds, lookups.start_failed
        self._holding, self._pools = lookups.holding, lookups.pools
        self._endpoints, self._by_replica = endpoints, by_replica
        self.prefixes.keep_only(endpoints)
        self.fingerprint = fingerprint
        self.generation += 1
        return True

    def resolve(self, name: str) -> str | None:
        """The public name `name` refers to (itself or the model it is an alias of), or None."""
        return self._names.get(name)

    def base_of(self, name: str) -> str | None:
        """The base model of the adapter whose public name is `name`; None when `name` is not an adapter's."""
        adapter = self._adapters.get(name)
        return None if adapter is None else adapter.base

    def adapters(self) -> dict[str, AdapterEntry]:
        """Public adapter name -> its entry (base, aliases, holders), as last published."""
        return self._adapters

    # Whose notes speak for a hold of `model`'s requests: its own; an adapter's, its base's while the base has no
    # ready replica (nothing can load it before one starts), and none while one runs (loading it is all it takes).
    def _notes_of(self, model: str) -> str:
        adapter = self._adapters.get(model)
        if adapter is None:
            return model
        return "" if self._endpoints.get(adapter.base) else adapter.base

    def unplaceable(self, model: str, pools: frozenset[str] | None = None) -> str | None:
        """Why the control plane could not place `model` (an adapter: its idle base) for a key bound to `pools`
        (None: to none) at its last attempt, or None. A note on a start in some pools answers only keys of them all."""
        note = self._unplaceable.get(self._notes_of(model))
        return note[0] if note is not None and note[1] <= (pools or frozenset()) else None

    def start_failure(self, model: str) -> str | None:
        """Why `model`'s (an adapter: its idle base's) only replica failed (the engine's last words), or None."""
        return self._start_failed.get(self._notes_of(model))

    def start_seconds(self, model: str) -> float | None:
        """How long `model` (an adapter: its idle base) has taken to start (learned), or None if unknown."""
        return self._start_seconds.get(self._notes_of(model))

    def holding(self, model: str) -> str | None:
        """Why the control plane holds `model`'s requests when that is not a start (`wake`, `making_room`), or None.

        An adapter's: ADAPTER_LOAD while its load is under way or its base runs (a load is all it waits for),
        else its base's reason."""
        adapter = self._adapters.get(model)
        if adapter is not None and (adapter.loading or self._endpoints.get(adapter.base)):
            return ADAPTER_LOAD
        return self._holding.get(self._notes_of(model))

    def serves_pools(self, model: str, pools: frozenset[str]) -> bool:
        """Whether `model` (an adapter: its base) has a profile in `pools` (empty: any); unknown pools refuse none."""
        have = self._pools.get(self._adapters[model].base if model in self._adapters else model)
        return not pools or have is None or not have.isdisjoint(pools)

    def catalog(self) -> dict[str, list[str]]:
        """Public model name -> aliases, as last published."""
        return self._catalog

    def endpoints(self, model: str | None = None) -> list[Endpoint]:
        if model is not None:
            return list(self._endpoints.get(model, ()))
        return list(self._by_replica.values())

    def has_choice(self, model: str) -> bool:
        """Whether `model` (or adapter) has more than one ready replica to choose from."""
        return len(self._endpoints.get(model, ())) > 1

    # -- per request ------------------------------------------------------------
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
        is ejected, the one ejected longest ago. The choice and the last-use
        stamp are one step of the loop, so a stamp always names the replica
        actually used.
        """
        candidates = self._endpoints.get(model)
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
        now = self._clock()
        self._stamps[chosen.replica_id] = now
        base = chosen.model
        if base != model:  # `model` is an adapter riding on `base`
            key = chosen.replica_id + ADAPTER_STAMP_SEPARATOR + model
            self._stamps[key] = now
            self._adapter_busy[key] = self._adapter_busy.get(key, 0) + 1
            self._count_in_flight(model)  # its own load too: the leader spreads a busy adapter over more replicas
        self._count_in_flight(base)
        return chosen

    def _count_in_flight(self, name: str) -> None:
        in_flight = self._in_flight.get(name, 0) + 1
        self._in_flight[name] = in_flight
        if in_flight > self._peaks.get(name, 0):
            self._peaks[name] = in_flight

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
        try:  # noqa: SIM105 (contextlib.suppress costs a context manager per request)
            self._in_flight[endpoint.model] -= 1
        except KeyError:  # a release without its pick: nothing was counted
            pass
        if model is not None and model != endpoint.model:
            self._in_flight[model] -= 1
            self._adapter_released(endpoint.replica_id + ADAPTER_STAMP_SEPARATOR + model)
        if failure is None:
            # A probe that ended without an outcome (the client left): let another request probe.
            endpoint.health.probing = False
            return
        change = self._record_failure(endpoint, failure)
        if change:
            self._log_change(endpoint, change)

    def _adapter_released(self, key: str) -> None:
        left = self._adapter_busy.get(key, 0) - 1
        if left > 0:
            self._adapter_busy[key] = left
        else:
            self._adapter_busy.pop(key, None)

    def failed(self, endpoint: Endpoint, failure: Failure) -> None:
        """A request still counted against `endpoint` failed (a 5xx relayed to the client as it is)."""
        change = self._record_failure(endpoint, failure)
        if change:
            self._log_change(endpoint, change)

    def succeeded(self, endpoint: Endpoint) -> None:
        """`endpoint` answered a request (below 500): its failure streak ends; a half-open one is back."""
        health = endpoint.health
        if not (health.failures or health.ejected_until):
            return  # the hot path: a healthy replica stays healthy at the cost of two reads
        recovered = health.record_success(self._ejection_clock())
        if recovered:
            log.info("replica %s of %s answered its probe and is back", endpoint.replica_id, endpoint.model)

    def _record_failure(self, endpoint: Endpoint, failure: Failure) -> str:
        """Count a failure; what changed, for `log_change`."""
        others = self._endpoints.get(endpoint.model, ())
        last_standing = all(other is endpoint or other.health.ejected_until for other in others)
        change = endpoint.health.record_failure(self.ejection, failure, self._ejection_clock(), last_standing)
        if change in ("ejected", "probe failed"):
            self._ejections[endpoint.model] = self._ejections.get(endpoint.model, 0) + 1
        return change

    def _log_change(self, endpoint: Endpoint, change: str) -> None:
        log_change(endpoint.replica_id, endpoint.model, endpoint.health, self.ejection, change)

    # -- outlier ejection, for metrics and /health --------------------------------------
    def ejected(self) -> list[Endpoint]:
        """The replicas ejected now (cooling down, or half-open awaiting their probe)."""
        return [e for e in self._by_replica.values() if e.health.ejected_until]

    def ejection_counts(self) -> dict[str, int]:
        """Ejections so far per public model name (a counter: never reset, not even by a new table)."""
        return dict(self._ejections)

    # -- last-use stamps ----------------------------------------------------------
    def take_usage(self) -> tuple[dict[str, float], dict[str, int]]:
        """Swap out the stamps and the per-model in-flight peaks gathered since the last take.

        A replica serving a request right now is stamped "now" as well (and so is
        an adapter on a replica serving it), so a long stream keeps its replica
        and adapter in use and the idle timeout cannot stop it mid-answer. The next peak window starts at what is in flight now, so a
        long request still counts in every window it spans. The cost grows with
        replicas, models and adapters, not with traffic.
        """
        stamps, self._stamps = self._stamps, {}
        peaks = self._peaks
        self._peaks = {model: count for model, count in self._in_flight.items() if count}
        busy = [e.replica_id for e in self._by_replica.values() if e.outstanding > 0]
        busy.extend(self._adapter_busy)
        if busy:
            now = self._clock()
            for replica_id in busy:
                stamps[replica_id] = now
        return stamps, peaks

    def restore_stamps(self, stamps: dict[str, float]) -> None:
        """Put back stamps a flush could not deliver; a newer stamp for the same replica wins."""
        for replica_id, ts in stamps.items():
            if ts > self._stamps.get(replica_id, float("-inf")):
                self._stamps[replica_id] = ts

    def in_flight(self) -> int:
        return sum(e.outstanding for e in self._by_replica.values())
