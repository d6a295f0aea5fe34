"""How many replicas each model wants: min and max, activations, scale-out on load, idle scale-down.

Demand is per model, set by its first profile (min and max replicas, target
concurrency); the placer may run a replica on any of the model's profiles
(`placing`). Each profile's own max caps the replicas running on it.

* min replicas are kept; replicas beyond max (the model's, or a profile's own)
  are stopped, the ones holding least first;
* an activation (a router holding requests for a model with no replica)
  creates one replica whose demand lasts while routers keep asking: if it is
  still unplaced LLMGW_ACTIVATION_LINGER_SECONDS after the last ask, it is
  withdrawn, so nothing starts later for nobody. An activation for a key
  bound to pools counts only the replicas in those pools (placed on a profile
  of one, or pending with nowhere else to go); its new replica keeps the pools
  (`Replica.pools`), so the placer tries only the profiles in them;
* scale-out: when the routers' requests in flight per ready replica stay
  above the target concurrency for LLMGW_SCALE_OUT_AFTER_SECONDS, one more
  replica (up to max), with the same lifetime as an activation; a model whose
  first profile sets latency objectives follows them instead
  (reconciler.demand.objectives: how many, and the hysteresis), and parks
  the replicas they no longer need so the idle timeout can stop them
  (reconciler.demand.spares);
* a swap under way: a sleeper stamped as wanted (`Replica.wanted_since`, by
  `swap.wake_for_demand`) still wants waking for LLMGW_ACTIVATION_LINGER_SECONDS
  after the stamp, without waiting for the routers' next ask: the tick its
  GPUs' occupant is reported asleep wakes it. Past that, or once the model has
  an awake replica, the stamp is stale and is cleared;
* idle scale-down: above min, a READY replica whose known last use is older
  than its profile's idle timeout (empty: LLMGW_DEFAULT_IDLE_TIMEOUT_SECONDS;
  0: never) is stopped — only while usage is known (DESIGN invariant 3), and
  never one whose engine reports running requests.

Stopping is a drain (`lifecycle.stop_shards`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Exists, OuterRef

from catalog.models import Alias, Profile
from hub.contracts import Activation, ModelWindow
from reconciler.choices import AWAKE_STATES, WANTED_STATES, ReplicaState
from reconciler.demand.idle import Idle
from reconciler.demand.objectives import Felt, has_objectives, look_ahead, seen_in_window, step
from reconciler.demand.spares import SpareChanges, decide, serving_and_parked
from reconciler.hibernate.tier import SleepRequest, idle_sleepers, put_to_sleep
from reconciler.lifecycle.replica_rows import FleetCensus, ReplicaRow
from reconciler.lifecycle.transitions import StopRequest, stop_replicas
from reconciler.models import ModelLoad, Replica, Shard

log = logging.getLogger(__name__)

# When a model has too many replicas, stop the ones holding least first.
_STOP_ORDER: dict[str, int] = {
    ReplicaState.FAILED: 0,
    ReplicaState.SLEEPING: 1,
    ReplicaState.PENDING: 2,
    ReplicaState.STARTING: 3,
    ReplicaState.WAKING: 4,
    ReplicaState.READY: 5,
}


@dataclass
class DemandOutcome:
    """What applying demand changed."""

    created: int = 0
    stopping: int = 0
    deleted: int = 0
    idle_stopped: int = 0
    scaled_out: int = 0
    withdrawn: int = 0
    slept: int = 0
    unknown_activations: list[str] = field(default_factory=list)
    wake: set[int] = field(default_factory=set)
    """Models whose requests (or min replicas) want a sleeper woken (reconciler.hibernate.tier)."""
    census: FleetCensus = field(default_factory=FleetCensus)
    """The fleet's replicas as demand read them, before its own changes."""


def idle_timeout(profile: Profile) -> float | None:
    """Seconds unused after which a replica on `profile` above min is stopped; None: never."""
    if profile.idle_timeout_seconds is None:
        return settings.LLMGW_DEFAULT_IDLE_TIMEOUT_SECONDS
    return float(profile.idle_timeout_seconds) or None


@dataclass
class _ModelDemand:
    """One model's profiles (in order) and replicas, as this tick sees them."""

    profiles: list[Profile]
    replicas: list[ReplicaRow] = field(default_factory=list)

    @property
    def primary(self) -> Profile:
        return self.profiles[0]

    def wanted(self) -> list[ReplicaRow]:
        # A replica a node drain is replacing is on its way out: its replacement counts instead.
        return [r for r in self.replicas if r.state in WANTED_STATES and r.drain_deadline is None]

    def awake(self) -> list[ReplicaRow]:
        """The wanted replicas that serve or will without a wake: every one but the sleepers."""
        return [r for r in self.wanted() if r.state in AWAKE_STATES]

    def sleepers(self) -> list[ReplicaRow]:
        return [r for r in self.wanted() if r.state == ReplicaState.SLEEPING]

    def serving(self, pools: frozenset[str]) -> list[ReplicaRow]:
        """The wanted replicas that serve a key bound to `pools` (empty: a key bound to none); see `lands_in`."""
        pool_of = {p.pk: p.pool for p in self.profiles}
        return [r for r in self.wanted() if self.lands_in(pools, r.state, pool_of.get(r.profile_id), r.pools)]

    def lands_in(self, pools: frozenset[str], state: str, pool: str | None, bound: list[str]) -> bool:
        """Whether a replica (in `state`, on a profile of `pool`, bound to the pools `bound`) serves a key bound to
        `pools` (empty: any pool): placed, when it is in one of them; pending, when every profile it may go on is
        in one. A pending replica bound to pools serves no unbound key: one pool's lack of room must not hold up
        a start anywhere."""
        if state != ReplicaState.PENDING:
            return not pools or pool in pools
        if not pools:
            return not bound
        return all(p.pool in pools for p in self.profiles if not bound or p.pool in bound)


def apply_demand(
    activations: set[Activation],
    now: datetime,
    *,
    usage_known: bool = True,
    in_flight: dict[str, int] | None = None,
    windows: dict[str, ModelWindow] | None = None,
) -> DemandOutcome:
    """Apply demand for every model; see the module docstring. A constant number of queries.

    `usage_known`: whether idleness may be acted on this tick. `in_flight` and `windows`: the routers' requests in
    flight and windows (hub.windows) per model name (None when usage could not be collected: load is left as it was).
    """
    outcome = DemandOutcome()
    models, lapsed, outcome.census = _read_models(now)
    busy = {r.pk for demand in models.values() for r in demand.replicas if r.busy}
    to_create: list[Replica] = []
    to_stop: list[StopRequest] = []
    to_sleep: list[SleepRequest] = []
    renew: list[int] = []  # pending replicas whose demand is renewed this tick
    linger = now + timedelta(seconds=settings.LLMGW_ACTIVATION_LINGER_SECONDS)

    for demand in models.values():
        model = demand.primary.model
        if not model.enabled:
            to_stop.extend(StopRequest(r, "model disabled") for r in demand.replicas)
            continue
        wanted = _bound(demand, to_create, to_stop, outcome.wake)
        if usage_known:
            idle = _idle_beyond_timeout(demand, wanted, busy, now)
            to_stop.extend(idle)
            outcome.idle_stopped += len(idle)
            stopped = {request.replica.pk for request in idle}
            to_sleep.extend(idle_sleepers(demand.profiles, [r for r in wanted if r.pk not in stopped], busy, now))

    if in_flight is not None:
        outcome.scaled_out = _scale_out(models, _Loads(in_flight, windows or {}), now, to_create, renew, linger)
    if activations:
        to_create.extend(_activate(activations, models, renew, linger, outcome))
    _swaps_under_way(models, now, outcome)

    if to_create:
        Replica.objects.bulk_create(to_create)
        outcome.created = len(to_create)
    if renew:
        Replica.objects.filter(pk__in=renew, state=ReplicaState.PENDING).update(demand_until=linger)
    # Waiting requests gave up on a replica that never found room: nothing should start later for nobody.
    # Only those read lapsed and not renewed above, so a tick with none runs no query for it.
    renewed = set(renew)
    lapsed = [pk for pk in lapsed if pk not in renewed]
    withdrawn = 0
    if lapsed:
        withdrawn, _ = Replica.objects.filter(pk__in=lapsed, state=ReplicaState.PENDING, demand_until__lt=now).delete()
    outcome.withdrawn = withdrawn
    if withdrawn:
        log.info("withdrew %d unplaced replicas nobody waits for any more", withdrawn)
    outcome.deleted, outcome.stopping = stop_replicas(to_stop, now)
    outcome.slept = put_to_sleep(to_sleep, now)
    return outcome


def _read_models(now: datetime) -> tuple[dict[int, _ModelDemand], list[int], FleetCensus]:
    """Every model with a profile, its profiles in order and its replicas not already stopping (each marked busy
    when a shard of it reports running requests); the pending replicas whose demand lapsed before `now` (whatever
    their model); and the census of every replica. Two queries."""
    models: dict[int, _ModelDemand] = {}
    for profile in Profile.objects.select_related("model").order_by("model_id", "order", "id"):
        models.setdefault(profile.model_id, _ModelDemand([])).profiles.append(profile)
    running = Shard.objects.filter(replica=OuterRef("pk"), running__gt=0)
    rows = Replica.objects.annotate(busy=Exists(running)).values_list(*ReplicaRow.COLUMNS)
    lapsed = []
    read = [ReplicaRow(*row) for row in rows]
    for replica in read:
        if replica.state == ReplicaState.STOPPING:
            continue
        if replica.state == ReplicaState.PENDING and replica.demand_until is not None and replica.demand_until < now:
            lapsed.append(replica.pk)
        if replica.model_id in models:
            models[replica.model_id].replicas.append(replica)
    return models, lapsed, FleetCensus.of(read)


def _bound(
    demand: _ModelDemand, to_create: list[Replica], to_stop: list[StopRequest], wake: set[int]
) -> list[ReplicaRow]:
    """Keep the model between its min and max, and each profile at most at its own max; the replicas kept."""
    primary = demand.primary
    wanted = demand.wanted()
    keep: list[ReplicaRow] = []
    for profile in demand.profiles:
        on_profile = [r for r in wanted if r.profile_id == profile.pk]
        kept = _trim(on_profile, profile.max_replicas, f"above the max of {profile} ", to_stop)
        keep.extend(kept)
    keep = _trim(keep, primary.max_replicas, "above the model's max replicas", to_stop)
    awake = [r for r in keep if r.state in AWAKE_STATES]
    missing = primary.min_replicas - len(awake)
    if missing > 0:
        # Below min with sleepers: they are woken (reconciler.hibernate.tier), new ones only for the rest.
        sleepers = len(keep) - len(awake)
        if sleepers:
            wake.add(primary.model_id)
        to_create.extend(Replica(model_id=primary.model_id, profile=primary) for _ in range(max(0, missing - sleepers)))
    return keep


def _swaps_under_way(models: dict[int, _ModelDemand], now: datetime, outcome: DemandOutcome) -> None:
    """Models with a sleeper stamped as wanted within the linger still want it woken (the module docstring);
    stale stamps are cleared. No query unless a stamp is stale."""
    since = now - timedelta(seconds=settings.LLMGW_ACTIVATION_LINGER_SECONDS)
    stale: list[int] = []
    for demand in models.values():
        stamped = [r.wanted_since for r in demand.sleepers() if r.wanted_since is not None]
        model_id = demand.primary.model_id
        if not stamped or model_id in outcome.wake:
            continue
        if not demand.awake() and any(wanted_since >= since for wanted_since in stamped):
            # The routers asked a moment ago and are holding requests: waking need not wait for their next ask.
            outcome.wake.add(model_id)
        else:
            stale.extend(r.pk for r in demand.sleepers() if r.wanted_since is not None)
    if stale:
        Replica.objects.filter(pk__in=stale).update(wanted_since=None)


def _trim(replicas: list[ReplicaRow], limit: int, why: str, to_stop: list[StopRequest]) -> list[ReplicaRow]:
    if len(replicas) <= limit:
        return replicas
    # Newest first within a state: keep the replicas that have been serving longest.
    ranked = sorted(replicas, key=lambda r: (_STOP_ORDER[r.state], -r.pk))
    excess = len(replicas) - limit
    to_stop.extend(StopRequest(r, why.strip()) for r in ranked[:excess])
    return ranked[excess:]


def _idle_beyond_timeout(
    demand: _ModelDemand, wanted: list[ReplicaRow], busy: set[int], now: datetime
) -> list[StopRequest]:
    """Replicas whose known last use is older than their profile's idle timeout, longest idle first: READY ones
    above min, and SLEEPING ones whatever min (a sleeper serves nothing; its sleeping time counts as idle)."""
    spare = len([r for r in wanted if r.state in AWAKE_STATES]) - demand.primary.min_replicas
    profiles = {p.pk: p for p in demand.profiles}
    idle: list[tuple[float, ReplicaRow, float]] = []  # (idle seconds, replica, its timeout)
    sleeping: list[tuple[float, ReplicaRow, float]] = []
    for replica in wanted:
        timeout = idle_timeout(profiles[replica.profile_id])
        if replica.state not in (ReplicaState.READY, ReplicaState.SLEEPING) or timeout is None or replica.pk in busy:
            continue
        since = Idle.since(replica.last_used, now)
        if since.seconds is not None and since.seconds > timeout:
            (sleeping if replica.state == ReplicaState.SLEEPING else idle).append((since.seconds, replica, timeout))
    idle.sort(key=lambda item: -item[0])
    return [
        StopRequest(replica, f"idle for {Idle(seconds)} (timeout {Idle(timeout)})")
        for seconds, replica, timeout in sleeping + idle[: max(0, spare)]
    ]


def _scale_out(
    models: dict[int, _ModelDemand],
    load_of: _Loads,
    now: datetime,
    to_create: list[Replica],
    renew: list[int],
    linger: datetime,
) -> int:
    """Record each model's load and what its users felt; add replicas to models whose load per ready replica
    stayed above target or, with objectives, that stayed over them (reconciler.demand.objectives).

    Two queries at most (read the loads, write the changed ones) plus one per new load row batch, and two when
    spare replicas are parked or brought back (reconciler.demand.spares).
    """
    loads = {load.model_id: load for load in ModelLoad.objects.all()}
    after = timedelta(seconds=settings.LLMGW_SCALE_OUT_AFTER_SECONDS)
    window = timedelta(seconds=settings.LLMGW_LATENCY_WINDOW_SECONDS)
    changed: list[ModelLoad] = []
    created: list[ModelLoad] = []
    scaled = 0
    for model_id, demand in models.items():
        primary = demand.primary
        if not primary.model.enabled:
            continue
        current, felt = load_of.in_flight.get(primary.model.name, 0), load_of.felt(primary)
        load = loads.get(model_id)
        if load is None:
            if not current and felt == Felt():
                continue
            load = ModelLoad(model_id=model_id)
            created.append(load)
        before = _load_fields(load)
        wanted = demand.wanted()
        coming = [r for r in wanted if r.state in (ReplicaState.PENDING, ReplicaState.STARTING)]
        over, add = _over(primary, load, felt, current, wanted, len(coming), now, load_of.spares)
        load.in_flight = current
        if not over:
            load.busy_since = None
        elif load.busy_since is None:
            load.busy_since = now
        add = min(add, primary.max_replicas - len(wanted))
        # While replicas it added are starting, a model with objectives adds more only once a whole window has
        # been read since: the first tokens that waited for them would otherwise ask for them again.
        wait = max(after, window) if coming and load.pressure is not None else after
        if add > 0 and load.busy_since is not None and now - load.busy_since >= wait:
            to_create.extend(Replica(model_id=model_id, profile=primary, demand_until=linger) for _ in range(add))
            load.busy_since = now  # the next replica waits for the load to last again
            scaled += add
            log.info("scaling %s out by %d: %s", primary.model.name, add, _why(load, current))
        elif over:
            renew.extend(r.pk for r in coming if r.demand_until is not None)
        if load.pk is not None and _load_fields(load) != before:
            changed.append(load)
    if created:
        ModelLoad.objects.bulk_create(created)
    if changed:
        ModelLoad.objects.bulk_update(changed, _LOAD_FIELDS)
    load_of.spares.apply(now)
    return scaled


@dataclass(frozen=True)
class _Loads:
    """What the routers reported: requests in flight and windows per public model name."""

    in_flight: dict[str, int]
    windows: dict[str, ModelWindow]
    spares: SpareChanges = field(default_factory=SpareChanges)

    def felt(self, primary: Profile) -> Felt:
        return Felt.of(primary, self.windows.get(primary.model.name))


_LOAD_FIELDS = [
    "in_flight",
    "busy_since",
    "calm_since",
    "trend",
    "ttft_p90",
    "itl_p90",
    "ttft_attained",
    "itl_attained",
    "pressure",
    "queue",
    "served",
]


def _load_fields(load: ModelLoad) -> tuple:
    return tuple(getattr(load, name) for name in _LOAD_FIELDS)


def _over(
    primary: Profile,
    load: ModelLoad,
    felt: Felt,
    current: int,
    wanted: list[ReplicaRow],
    coming: int,
    now: datetime,
    spares: SpareChanges,
) -> tuple[bool, int]:
    """Whether the model is over its target (or objectives) now, and the replicas to add once that has lasted
    (less the parked ones brought back, reconciler.demand.spares); records what its users felt on `load`."""
    load.ttft_p90, load.itl_p90 = felt.ttft_p90, felt.itl_p90
    load.ttft_attained, load.itl_attained = felt.ttft_attained, felt.itl_attained
    load.queue, load.served = felt.queue, felt.served
    serving, parked = serving_and_parked(wanted)
    if has_objectives(primary):
        was_over = load.busy_since is not None
        up, down = settings.LLMGW_OBJECTIVE_SCALE_UP, settings.LLMGW_OBJECTIVE_SCALE_DOWN
        window = settings.LLMGW_LATENCY_WINDOW_SECONDS
        seen = seen_in_window([r.ready_at for r in serving], now, window)
        growth, load.trend = look_ahead(load.trend, felt.streams, now.timestamp(), primary.start_seconds, window)
        objective = step(felt.ratio, seen, len(serving), coming, was_over, up, down, growth)
        load.pressure = objective.pressure
        recalled = decide(load, objective.pressure, serving, parked, primary.min_replicas, now, spares, coming)
        return objective.over, max(0, objective.add - recalled)
    load.pressure = load.calm_since = None
    spares.recall.extend(r.pk for r in parked)  # objectives gone: nothing stays parked
    ready = len(serving) + len(parked)
    over = ready > 0 and current > ready * primary.target_concurrency
    # One at a time, and none while one is on its way: its share of the load is not known yet.
    return over, 1 if over and not coming else 0


def _why(load: ModelLoad, current: int) -> str:
    if load.pressure is not None:
        return (
            f"pressure {load.pressure:.2f} (p90 first token {load.ttft_p90 or 0:.3f} s, gap {load.itl_p90 or 0:.3f} s; "
            "replicas starting discounted)"
        )
    return f"{current} requests in flight over its target concurrency"


def _activate(
    activations: set[Activation],
    models: dict[int, _ModelDemand],
    renew: list[int],
    linger: datetime,
    outcome: DemandOutcome,
) -> list[Replica]:
    """One new replica per activated model that wants none (none in the asked pools, when it names some);
    aliases resolve. It goes on the model's first profile, or its first in the asked pools.

    A model that already has an unplaced replica created for waiting requests
    gets that replica's demand renewed instead.
    """
    by_name = {d.primary.model.name: d for d in models.values() if d.primary.model.enabled}
    asked = {a.model for a in activations}
    unresolved = asked - by_name.keys()
    names = {name: name for name in asked}
    if unresolved:
        names.update(Alias.objects.filter(name__in=unresolved).values_list("name", "model__name"))
    created: list[Replica] = []
    for activation in sorted(activations, key=lambda a: (a.model, a.pools)):
        demand = by_name.get(names[activation.model])
        if demand is None:
            outcome.unknown_activations.append(activation.model)
            continue
        pools = frozenset(activation.pools)
        serving = demand.serving(pools)
        if not any(r.state in AWAKE_STATES for r in serving) and any(r.state == ReplicaState.SLEEPING for r in serving):
            outcome.wake.add(demand.primary.model_id)  # a swap, not a cold start (reconciler.hibernate.tier)
        elif not serving:
            replica = _new_for(demand, pools, created, linger)
            if replica is not None:
                created.append(replica)
        renew.extend(r.pk for r in serving if r.state == ReplicaState.PENDING and r.demand_until is not None)
    if outcome.unknown_activations:
        log.warning("activation requested for unknown or disabled models: %s", outcome.unknown_activations)
    return created


def _new_for(demand: _ModelDemand, pools: frozenset[str], created: list[Replica], linger: datetime) -> Replica | None:
    """A new replica of `demand`'s model for requests of a key bound to `pools` (empty: any), or None when one
    created this tick serves them already, when no profile is in them, or when the model is at its max."""
    model_id = demand.primary.model_id
    mine = [r for r in created if r.model_id == model_id]
    if any(demand.lands_in(pools, ReplicaState.PENDING, None, r.pools) for r in mine):
        return None
    profile = next((p for p in demand.profiles if not pools or p.pool in pools), None)
    if profile is None:
        # Routers refuse such keys at once (the table lists each model's pools); this one read an older table.
        log.warning("activation of %s in pools %s, where it has no profile", demand.primary.model.name, sorted(pools))
        return None
    if len(demand.wanted()) + len(mine) >= demand.primary.max_replicas:
        log.warning("activation of %s in pools %s: the model is at its max replicas", profile.model.name, sorted(pools))
        return None
    return Replica(model_id=model_id, profile=profile, pools=sorted(pools), demand_until=linger)
