"""The one eviction order, and the fewest victims that really make room (DESIGN "One eviction order").

Pure functions over plain data, no ORM, like `placement`. An `Occupant` is a
READY replica as eviction sees it: who it is, how idle, and which in-service
GPUs it holds on which nodes. `stop_candidates` applies the rules that make a
replica stoppable at all; `plan_eviction` picks, for one waiting shape, the
fewest candidates whose GPUs make `placement.place` succeed.

Rules for a candidate (each one a guard against stopping something wanted):

* its last use is known and at least `min_idle` seconds ago (unknown is never idle);
* it has been ready at least `min_residency` seconds (so the fleet cannot thrash);
* no shard reports running requests (the engine's own count; the router's
  stamps already keep a replica with requests in flight from looking idle);
* its priority is at most the waiting model's;
* stopping it leaves its model at or above its min replicas.

Being in use (the first and third rules) keeps requests held for another
model waiting a bounded time only (`in_use_no_reason`).

Order: lowest priority first, then least recently used. Among the ways to
make room, the fewest victims win; ties go to the way whose worst victim comes
earliest in that order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

from reconciler.placement.search import NodeCapacity, Placement, Shape, place

MAKING_ROOM = "making room: "
"""Text before a waiting replica's placement note while its victims drain (`Hold.MAKING_ROOM`)."""

WAITING_FOR_NODES = "waiting for nodes to report in: "
"""Text before a placement note while a new leader's fleet may not have reported in (`Hold.WAITING_FOR_NODES`)."""


@dataclass(frozen=True)
class Occupant:
    """A READY replica as eviction and "what can I stop" see it."""

    replica_id: int
    model: str
    priority: int
    idle_seconds: float | None
    """Seconds since last use; None when unknown."""
    ready_seconds: float
    """Seconds since it became ready."""
    gpu_class: str
    gpus: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Node name -> indices of the in-service GPUs it holds there."""
    running: int | None = None
    """Requests its engines report running (summed over shards); None when unknown."""
    pool: str = ""
    """Its profile's pool: whose requests it serves (a key bound to pools is served in those only)."""

    @property
    def gpu_count(self) -> int:
        return sum(len(indices) for indices in self.gpus.values())

    def order_key(self) -> tuple:
        """The one eviction order: lowest priority, then longest idle, then oldest id."""
        return (self.priority, -(self.idle_seconds or 0.0), self.replica_id)


def stop_candidates(
    occupants: Iterable[Occupant],
    spare: Mapping[str, int],
    *,
    min_idle: float,
    min_residency: float,
    max_priority: int | None = None,
    soon: bool = False,
) -> list[Occupant]:
    """The occupants that may be stopped, in eviction order.

    `spare` is, per model, how many replicas it has above its min replicas;
    at most that many of a model's replicas are returned. `max_priority` is the
    waiting model's priority (None: any priority, for "what can I stop").
    `soon`: the occupants that will be stoppable once time has passed — not yet
    idle or resident long enough, or still running requests — but never one
    whose idleness is unknown, of a higher priority, or needed for its min.
    """
    eligible = sorted(
        (
            h
            for h in occupants
            if h.idle_seconds is not None
            and (soon or (h.idle_seconds >= min_idle and h.ready_seconds >= min_residency and not h.running))
            and (max_priority is None or h.priority <= max_priority)
        ),
        key=Occupant.order_key,
    )
    left = dict(spare)
    chosen = []
    for holding in eligible:
        if left.get(holding.model, 0) > 0:
            left[holding.model] -= 1
            chosen.append(holding)
    return chosen


def in_use_no_reason(occupants: Iterable[Occupant], min_idle: float) -> list[Occupant]:
    """The occupants as a demand that has waited LLMGW_MAX_SWAP_WAIT_SECONDS sees them: being in use (used lately,
    or running requests) no longer keeps one from being evicted — its engine drains, so nothing is cut — but its
    residency, priority and model's min still do, and one whose idleness is unknown is still never a candidate.
    The one bound a cold start and a swap both wait at most for occupants still in use."""
    return [
        replace(h, idle_seconds=max(h.idle_seconds, min_idle), running=0)
        for h in occupants
        if h.idle_seconds is not None
    ]


def others_than(model: str, occupants: Iterable[Occupant], taken: Collection[int]) -> list[Occupant]:
    """The occupants eviction may consider to make room for a replica of `model`: never that model's own
    replicas (stopping one to start another would only churn), nor one already taken (`taken`: replica ids)."""
    return [h for h in occupants if h.model != model and h.replica_id not in taken]


def seconds_until_stoppable(victims: Iterable[Occupant], *, min_idle: float, min_residency: float) -> float | None:
    """How long until every one of `victims` is stoppable, if nothing uses them meanwhile; None when one is
    running requests (it is stoppable only once they are done, which no clock says)."""
    if any(v.running for v in victims):
        return None
    return max(
        (max(min_idle - (v.idle_seconds or 0.0), min_residency - v.ready_seconds, 0.0) for v in victims), default=0.0
    )


def with_freed(capacity: Iterable[NodeCapacity], victims: Iterable[Occupant]) -> list[NodeCapacity]:
    """`capacity` as it would be once `victims` have stopped (their GPUs free)."""
    freed: dict[tuple[str, str], set[int]] = defaultdict(set)
    for victim in victims:
        for node_name, indices in victim.gpus.items():
            freed[(node_name, victim.gpu_class)].update(indices)
    result = []
    for node in capacity:
        extra = freed.get((node.name, node.gpu_class))
        if extra:
            free = tuple(sorted(set(node.free) | extra))
            node = replace(node, free=free)  # the rest (its GPUs' memory too) as it was
        result.append(node)
    return result


def plan_eviction(
    capacity: Iterable[NodeCapacity], shape: Shape, candidates: list[Occupant]
) -> tuple[list[Occupant], Placement] | None:
    """The fewest `candidates` (already in eviction order) whose GPUs make `shape` fit, and where it would go.

    None when stopping candidates cannot make room. Single node: per node, the
    first candidates there in order until enough GPUs are free. Multi-node: per
    fabric, the nodes whose every holder is a candidate, cheapest first, until
    enough whole nodes; a replica spanning two of them counts once.
    """
    nodes = [c for c in capacity if c.gpu_class == shape.gpu_class]
    rank = {h.replica_id: i for i, h in enumerate(candidates)}
    on_node: dict[str, list[Occupant]] = defaultdict(list)
    for holding in candidates:
        if holding.gpu_class == shape.gpu_class:
            for node_name in holding.gpus:
                on_node[node_name].append(holding)

    options: list[list[Occupant]] = []
    if shape.nodes_per_replica == 1:
        for node in nodes:
            victims = _victims_on_node(node, shape.gpus_per_node, on_node.get(node.name, []))
            if victims:
                options.append(victims)
    else:
        options.extend(_victims_for_fabrics(nodes, shape, on_node))

    # Fewest victims, then the earliest worst victim, then the earliest victims overall.
    options.sort(key=lambda vs: (len(vs), max(rank[v.replica_id] for v in vs), sorted(rank[v.replica_id] for v in vs)))
    for victims in options:
        result = place(with_freed(nodes, victims), shape)
        if isinstance(result, Placement):
            return victims, result
    return None


def _victims_on_node(node: NodeCapacity, need: int, holders: list[Occupant]) -> list[Occupant]:
    """The first holders (in order) whose GPUs on `node` bring its free count to `need`; [] if they cannot."""
    if node.total < need:
        return []
    free = len(node.free)
    victims = []
    for holder in holders:
        if free >= need:
            break
        victims.append(holder)
        free += len(holder.gpus[node.name])
    return victims if free >= need else []


def _victims_for_fabrics(
    nodes: list[NodeCapacity], shape: Shape, on_node: dict[str, list[Occupant]]
) -> list[list[Occupant]]:
    """Per fabric, the victims that free enough whole nodes (a node is usable only if every holder is a candidate)."""
    by_fabric: dict[str, list[tuple[NodeCapacity, list[Occupant]]]] = defaultdict(list)
    for node in nodes:
        if not node.fabric or node.total < shape.gpus_per_node:
            continue
        holders = on_node.get(node.name, [])
        held_by_candidates = sum(len(h.gpus[node.name]) for h in holders)
        if len(node.free) + held_by_candidates < node.total:
            continue  # something that may not be stopped (or an unhealthy GPU) keeps it from being whole
        by_fabric[node.fabric].append((node, holders))
    options = []
    for members in by_fabric.values():
        if len(members) < shape.nodes_per_replica:
            continue
        members.sort(key=lambda m: (len(m[1]), m[0].name))
        victims: dict[int, Occupant] = {}
        for _node, holders in members[: shape.nodes_per_replica]:
            victims.update((h.replica_id, h) for h in holders)
        if victims:
            options.append(list(victims.values()))
    return options
