"""Making room under pressure: stop replicas so a waiting one can be placed (DESIGN "One eviction order").

Runs in the tick after placement, for the replicas no profile could take, in
placement order. For each, on its profiles in order:

1. if GPUs already being freed (replicas draining) would make it fit, it
   waits for them — they are claimed for it, so the next waiting replica does
   not count them again, and nothing more is stopped;
2. otherwise `eviction.plan_eviction` picks the fewest candidates (the one
   eviction order) whose GPUs make it fit; they are stopped (a drain), and
   their GPUs are claimed for it.

Candidates are idle ones, by the one eviction order. A replica whose requests
are held (no ready replica of its model serves them, in its pools) is bounded
as a swap is (reconciler.hibernate.swap): once it has waited
LLMGW_MAX_SWAP_WAIT_SECONDS for room (from the first tick it found none,
`Replica.wanted_since`), occupants still in use are candidates too
(`eviction.in_use_no_reason`: a drain, nothing is cut; still never above its
priority, below their model's min, resident too briefly or of unknown
idleness). Until then it holds, its note saying when at the latest room comes.
A replica of a model already serving (a scale-out) waits for idle occupants
only: busy models do not drain each other.

Either way its hold is `Hold.MAKING_ROOM` (its note, for operators, starts
with `eviction.MAKING_ROOM`), so routers keep holding its requests instead of
answering "cannot be started"; it is placed by a later tick once the GPUs are
free. A constant number of queries.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, replace
from datetime import datetime

from django.conf import settings

from catalog.models import Profile
from inventory.models import gpu_in_service
from reconciler.choices import Hold, ReplicaState
from reconciler.demand.idle import Idle
from reconciler.hibernate.tier import SleepRequest, put_to_sleep
from reconciler.lifecycle.transitions import StopRequest, notify_work_due, stop_replicas
from reconciler.models import GPUAssignment, Replica
from reconciler.placement.capacity import CapacitySnapshot
from reconciler.placement.eviction import (
    MAKING_ROOM,
    WAITING_FOR_NODES,
    Occupant,
    in_use_no_reason,
    others_than,
    plan_eviction,
    seconds_until_stoppable,
    stop_candidates,
    with_freed,
)
from reconciler.placement.fit import MemoryCheck
from reconciler.placement.occupants import read_occupants, sleep_levels, spare_replicas
from reconciler.placement.search import NodeCapacity, Placement, Shape, place

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlacementNote:
    """Why a pending replica is not placed: the text operators read, and whether routers hold its requests.

    Written together to `Replica.placement_note` and `Replica.hold`; rules
    read the hold, never the text.
    """

    text: str
    hold: str = Hold.NONE

    @classmethod
    def making_room(cls, what: str) -> PlacementNote:
        return cls(MAKING_ROOM + what, Hold.MAKING_ROOM)

    @classmethod
    def waiting_for_nodes(cls, reason: str) -> PlacementNote:
        return cls(WAITING_FOR_NODES + reason, Hold.WAITING_FOR_NODES)


def make_room(
    waiting: list[tuple[Replica, list[Profile], str]],
    capacity: CapacitySnapshot,
    now: datetime,
    memory: MemoryCheck,
    *,
    paused: str = "",
) -> dict[int, PlacementNote]:
    """Decide, for each waiting (replica, profiles it may use, why not), whether to wait or to stop victims.

    `paused` says why nothing may be evicted this tick ("" when eviction may
    act): then nothing is stopped, but a replica that eviction would make room
    for still holds its requests instead of being refused — a usage store that
    has just come back, or a control plane that has just started, is not a
    reason to answer "cannot be started" for a model a tick later would place.
    Returns the placement note (holding: making room) of each replica that now waits for room.
    """
    draining = _draining_gpus(now)
    # Read only when some replica needs victims: while victims drain, waiting costs one query a tick.
    occupants: list[Occupant] | None = None
    spare: dict[str, int] = {}
    taken: set[int] = set()  # replicas chosen as victims this tick
    notes: dict[int, PlacementNote] = {}
    victims_all: list[StopRequest] = []
    for replica, profiles, _reason in waiting:
        model = replica.model.name
        want: _Want | None = None
        shapes: list[tuple[list[NodeCapacity], Shape]] = []
        for profile in profiles:
            shape = Shape.of(profile)
            # Nodes whose GPUs are too small for the profile are no use, however much is stopped on them.
            records = memory.records(capacity, profile)
            shapes.append((records, shape))
            soon = _fits_with(records, draining, shape)
            if soon is not None:
                notes[replica.pk] = PlacementNote.making_room(f"waiting for GPUs being freed on {', '.join(soon)}")
                break
            if occupants is None:
                occupants, spare = read_occupants(now), spare_replicas()
            want = want or _Want.of(replica, occupants, now)
            if paused:
                continue
            plan = plan_eviction(records, shape, _candidates(occupants, spare, taken, want))
            if plan is None:
                continue
            victims, _placement = plan
            stopping = _claim(victims, model, taken, spare, victims_all)
            notes[replica.pk] = PlacementNote.making_room(f"stopping {stopping}")
            log.info("making room for %s on %s: stopping %s", model, profile.gpu_class, stopping)
            break
        else:
            # No profile can make room now: hold, don't refuse, if one will once time has passed.
            note = _first_room_soon(occupants, spare, taken, want, shapes, paused)
            if note is not None:
                notes[replica.pk] = note
    _sleep_or_stop(victims_all, now)
    return notes


def _claim(
    victims: list[Occupant], model: str, taken: set[int], spare: dict[str, int], requests: list[StopRequest]
) -> str:
    """Take `victims` for a replica of `model`: out of later replicas' candidates and of their models' spares,
    and to be stopped (or put to sleep) for it. Returns them described, for its note."""
    for victim in victims:
        taken.add(victim.replica_id)
        spare[victim.model] -= 1
        # Its GPUs are this replica's once free: they are not in `draining`, so no one else counts them.
        requests.append(StopRequest(_stub(victim), f"evicted for {model}: {_describe(victim)}"))
    return ", ".join(_describe(v) for v in victims)


@dataclass(frozen=True)
class _Want:
    """A waiting replica as eviction sees it: its model, its priority, and the seconds left until the one bound
    lets occupants still in use go for it (None: it never does, its model's requests being served meanwhile)."""

    model: str
    priority: int
    left: float | None

    @classmethod
    def of(cls, replica: Replica, occupants: list[Occupant], now: datetime) -> _Want:
        model, pools, priority = replica.model.name, replica.pools, replica.profile.priority
        # The bound is for requests held, as a swap's: while a ready replica of its model serves them (a scale-out,
        # a replica beyond one serving), it waits for idle occupants only, so busy models never drain each other.
        if any(h.model == model and (not pools or h.pool in pools) for h in occupants):
            return cls(model, priority, None)
        # Stamped the first tick it found no room (`placer._write_notes`), cleared when placed or failed: a replica
        # pending again after its node was lost starts a new wait. Unstamped, this tick is its first.
        waited = (now - (replica.wanted_since or now)).total_seconds()
        return cls(model, priority, max(0.0, settings.LLMGW_MAX_SWAP_WAIT_SECONDS - waited))

    @property
    def overdue(self) -> bool:
        """Its requests have been held the one bound (LLMGW_MAX_SWAP_WAIT_SECONDS): occupants in use may go."""
        return self.left == 0.0


def _candidates(
    occupants: list[Occupant], spare: dict[str, int], taken: set[int], want: _Want, *, soon: bool = False
) -> list[Occupant]:
    """The one eviction order's candidates for `want`, among those not chosen this tick; once its requests have
    been held the one bound, occupants still in use among them (`eviction.in_use_no_reason`)."""
    others = others_than(want.model, occupants, taken)
    if want.overdue and not soon:
        others = in_use_no_reason(others, settings.LLMGW_EVICT_MIN_IDLE_SECONDS)
    return stop_candidates(
        others,
        spare,
        min_idle=settings.LLMGW_EVICT_MIN_IDLE_SECONDS,
        min_residency=settings.LLMGW_MIN_RESIDENCY_SECONDS,
        max_priority=want.priority,
        soon=soon,
    )


def _sleep_or_stop(victims: list[StopRequest], now: datetime) -> None:
    """The one eviction order, extended: a victim whose engine can sleep sleeps (a swap back is seconds), the
    rest are stopped. Either way its GPUs are free once its engine has drained."""
    if not victims:
        return
    levels = sleep_levels([request.replica.pk for request in victims])
    sleepers = [SleepRequest(r.replica.pk, levels[r.replica.pk], r.reason) for r in victims if levels.get(r.replica.pk)]
    put_to_sleep(sleepers, now)
    stop_replicas([r for r in victims if not levels.get(r.replica.pk)], now)


def _first_room_soon(
    occupants: list[Occupant] | None,
    spare: dict[str, int],
    taken: set[int],
    want: _Want | None,
    shapes: list[tuple[list[NodeCapacity], Shape]],
    paused: str,
) -> PlacementNote | None:
    """The hold note of the first profile that will have room once time has passed (None: none will, or the
    occupants were never read, no replica having needed victims)."""
    if occupants is None or want is None:
        return None
    for records, shape in shapes:
        note = _room_soon(occupants, spare, taken, want, records, shape, paused)
        if note is not None:
            return note
    return None


def _room_soon(
    occupants: list[Occupant],
    spare: dict[str, int],
    taken: set[int],
    want: _Want,
    records: list[NodeCapacity],
    shape: Shape,
    paused: str,
) -> PlacementNote | None:
    """Hold, don't refuse: when replicas that will be evictable once time passes (not idle or resident long
    enough yet, or finishing requests) or once eviction may act again (`paused`) would make room, the waiting
    replica holds its requests until they are (nothing is stopped now; a later tick stops them by the usual
    rules). None when not even that would do.

    While paused, a replica whose idleness is unknown counts as one that may
    become evictable: its routers' stamps may not have been collected yet (a
    control plane that has just started). Once eviction may act, a replica
    still of unknown idleness is not a candidate, and the waiting one is refused.
    """
    if paused:
        known = {h.replica_id: h for h in occupants}
        occupants = [h if h.idle_seconds is not None else replace(h, idle_seconds=0.0) for h in occupants]
    plan = plan_eviction(records, shape, _candidates(occupants, spare, taken, want, soon=True))
    if plan is None:
        return None
    victims, _placement = plan
    if paused:
        held = ", ".join(_describe(known[v.replica_id]) for v in victims)
        return PlacementNote.making_room(f"nothing is evicted while {paused}; then {held} may make room")
    wait, when = _when_evictable(victims, want)
    if wait:  # (None or 0: no clock to wait for, or one the next regular tick will find passed)
        notify_work_due(wait)
    return PlacementNote.making_room(f"waiting for {', '.join(_describe(v) for v in victims)} to be evictable {when}")


def _when_evictable(victims: list[Occupant], want: _Want) -> tuple[float | None, str]:
    """Seconds until `victims` may be evicted for `want` (None: once their requests finish, which no clock says),
    and the words its note says it in: in use is a reason only until its requests have been held the one bound,
    if they are; residency stays one."""
    wait = seconds_until_stoppable(
        victims, min_idle=settings.LLMGW_EVICT_MIN_IDLE_SECONDS, min_residency=settings.LLMGW_MIN_RESIDENCY_SECONDS
    )
    if want.left is None:
        return wait, "once their requests finish" if wait is None else f"in about {Idle(wait)}"
    residency = max((settings.LLMGW_MIN_RESIDENCY_SECONDS - v.ready_seconds for v in victims), default=0.0)
    latest = max(want.left, residency)
    if wait is None:
        return latest, f"once their requests finish, at the latest in about {Idle(latest)}"
    wait = min(wait, latest)
    return wait, f"in about {Idle(wait)}"


def _stub(holding: Occupant) -> Replica:
    """Enough of a Replica row for `stop_replicas` (it reads the id and the state)."""
    return Replica(pk=holding.replica_id, state=ReplicaState.READY)


def _describe(holding: Occupant) -> str:
    idle = Idle(holding.idle_seconds)
    return f"replica {holding.replica_id} of {holding.model} ({holding.gpu_count} GPUs, idle {idle})"


def _draining_gpus(now: datetime) -> dict[tuple[str, str], set[int]]:
    """In-service GPUs held by STOPPING replicas and by sleepers not yet asleep, per (node, class): free once their
    engines have drained or gone to sleep. One query."""
    draining: dict[tuple[str, str], set[int]] = defaultdict(set)
    rows = GPUAssignment.objects.filter(
        shard__replica__state__in=(ReplicaState.STOPPING, ReplicaState.SLEEPING), awake=True
    ).values_list("shard__node__name", "gpu__gpu_class", "gpu__index", "gpu__health", "gpu__healthy_since")
    for node, gpu_class, index, health, healthy_since in rows:
        if gpu_in_service(health, healthy_since, now):
            draining[(node, gpu_class)].add(index)
    return draining


def _fits_with(
    records: list[NodeCapacity], draining: dict[tuple[str, str], set[int]], shape: Shape
) -> list[str] | None:
    """Nodes whose draining GPUs would make `shape` fit, claimed (removed from `draining`); None if they would not."""
    pseudo = [
        Occupant(0, "", 0, None, 0.0, shape.gpu_class, {node: tuple(sorted(indices))})
        for (node, gpu_class), indices in draining.items()
        if gpu_class == shape.gpu_class and indices
    ]
    if not pseudo:
        return None
    result = place(with_freed(records, pseudo), shape)
    if not isinstance(result, Placement):
        return None
    used = []
    for shard in result.shards:
        claimed = draining.get((shard.node, shape.gpu_class), set())
        if claimed & set(shard.gpu_indices):
            used.append(shard.node)
            claimed.difference_update(shard.gpu_indices)
    return used or None
