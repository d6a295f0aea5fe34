""" "What can I stop" (DESIGN "What can I stop"): the summary's `stoppable`, `idle_held_gpus` and `usage`.

The candidates are the reconciler's own (`eviction.stop_candidates` over
`occupants.read_occupants`), so status never offers a replica the tick would
refuse to stop: known-idle only, never one with running requests, never below
a model's min replicas. Here they are only ranked for an operator (most
GPU-seconds held while idle first) and explained: what stopping one frees, by
the placer's own rule for a whole node (`NodeCapacity.whole` after
`eviction.with_freed`), and which unplaceable models would then fit
(`placement.place` on each of their profiles).

When the fleet's usage is unknown (no usage watch yet, the watch lapsed, or no
leader collecting), idleness is unknown for everyone (DESIGN invariant 3):
`stoppable` is empty, nothing counts as idle-held, and `usage.reason` says why.

A fixed number of queries whatever the fleet size; everything per candidate
is computed in memory on the placer's records of the fleet's GPUs, which the
summary has read already (`records`: free GPUs by the placer's own rule).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings

from catalog.models import Profile
from dashboard.summary_types import IdleHeld, IdleHeldClass, Leader, StopCandidate, UsageState
from reconciler.choices import ReplicaState
from reconciler.demand.idle import Idle
from reconciler.models import Shard, UsageWatch
from reconciler.placement.eviction import Occupant, stop_candidates, with_freed
from reconciler.placement.occupants import read_occupants, spare_replicas
from reconciler.placement.search import NodeCapacity, Placement, Shape, place

USAGE_WATCH_NAME = "fleet"
IDLE_HELD_AFTER_SECONDS = 3600.0
"""A replica idle longer than this counts in `idle_held_gpus` (the "idle over an hour" total)."""


@dataclass(frozen=True)
class WhatCanIStop:
    """The summary's `usage`, `idle_held_gpus` and `stoppable`, read together."""

    usage: UsageState
    idle_held_gpus: IdleHeld
    stoppable: list[StopCandidate]


def usage_state(now: datetime, leader: Leader | None) -> UsageState:
    """Whether usage is known, since when, and why not, from the usage watch row. One query.

    `leader` is the summary's lease view: when its lease has expired no tick is
    collecting usage, so stamps stop moving and idle times would only grow;
    that is unknown too, whatever the row last said.
    """
    watch = UsageWatch.objects.filter(name=USAGE_WATCH_NAME).first()
    if watch is None:
        return UsageState(False, None, "no tick has collected usage yet")
    if watch.known_since is None:
        return UsageState(False, None, watch.reason or "usage is unknown")
    if leader is not None and leader.expires_in_seconds < 0:
        ago = -leader.expires_in_seconds
        return UsageState(False, None, f"the leader's lease expired {ago:.0f}s ago: no tick is collecting usage")
    return UsageState(True, watch.known_since.isoformat(), "")


def idle_held_gpus(occupants: Iterable[Occupant], gpu_classes: Iterable[str]) -> IdleHeld:
    """GPUs held by replicas known idle for over an hour, per class (every class listed, 0 included) and in total."""
    per_class: dict[str, int] = dict.fromkeys(gpu_classes, 0)
    for holding in occupants:
        per_class.setdefault(holding.gpu_class, 0)
        if holding.idle_seconds is not None and holding.idle_seconds > IDLE_HELD_AFTER_SECONDS:
            per_class[holding.gpu_class] += holding.gpu_count
    rows = [IdleHeldClass(gpu_class, gpus) for gpu_class, gpus in sorted(per_class.items())]
    return IdleHeld(sum(per_class.values()), rows)


def _unplaceable_shapes(models: Iterable[str]) -> dict[str, list[Shape]]:
    """Each named model's profile shapes, in the order they are tried. One query (none without models)."""
    names = sorted(set(models))
    shapes: dict[str, list[Shape]] = defaultdict(list)
    if not names:
        return shapes
    for row in (
        Profile.objects.filter(model__name__in=names)
        .order_by("model__name", "order", "id")
        .values_list("model__name", "gpu_class", "gpus_per_node", "nodes_per_replica", named=True)
    ):
        shapes[row.model__name].append(Shape.of(row))
    return shapes


def _plural(count: int, one: str, many: str) -> str:
    return f"a {one}" if count == 1 else f"{count} {many}"


def _join(phrases: list[str]) -> str:
    return phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]


class _Fleet:
    """The placer's records of the fleet indexed for per-candidate questions, once per summary."""

    def __init__(self, records: Mapping[str, Iterable[NodeCapacity]], unplaceable: dict[str, list[Shape]]):
        self.records: dict[str, dict[str, NodeCapacity]] = {}
        self.whole_on_fabric: dict[tuple[str, str], list[NodeCapacity]] = defaultdict(list)
        for gpu_class, nodes in records.items():
            self.records[gpu_class] = {r.name: r for r in nodes}
            for record in self.records[gpu_class].values():
                if record.whole and record.fabric:
                    self.whole_on_fabric[(gpu_class, record.fabric)].append(record)
        # A model that fits already is not unblocked by a stop (its error predates the room).
        self.unplaceable = {
            model: shapes
            for model, shapes in unplaceable.items()
            if not any(isinstance(place(self.records.get(s.gpu_class, {}).values(), s), Placement) for s in shapes)
        }

    def after_stopping(self, holding: Occupant) -> list[NodeCapacity]:
        """The holding's nodes as they would be once it stops (only schedulable ones have records)."""
        records = self.records.get(holding.gpu_class, {})
        return with_freed([records[name] for name in sorted(holding.gpus) if name in records], [holding])

    def frees(self, holding: Occupant, freed: list[NodeCapacity]) -> str:
        """What stopping it frees: whole nodes per fabric where it makes them whole, else GPUs per node."""
        gpu_class = holding.gpu_class
        whole: dict[str, int] = defaultdict(int)
        phrases = []
        for node in freed:
            if node.whole:
                whole[node.fabric] += 1
            else:
                count = len(holding.gpus[node.name])
                phrases.append(f"{_plural(count, f'{gpu_class} GPU', f'{gpu_class} GPUs')} on {node.name}")
        for fabric, count in sorted(whole.items()):
            where = f"on {fabric}" if fabric else "(no fabric)"
            phrases.insert(0, f"{_plural(count, f'whole {gpu_class} node', f'whole {gpu_class} nodes')} {where}")
        with_records = {node.name for node in freed}
        for name in sorted(set(holding.gpus) - with_records):
            count = len(holding.gpus[name])
            gpus = _plural(count, f"{gpu_class} GPU", f"{gpu_class} GPUs")
            phrases.append(f"{gpus} on {name} (not schedulable now)")
        return _join(phrases) if phrases else "nothing schedulable"

    def unblocks(self, holding: Occupant, freed: list[NodeCapacity]) -> list[str]:
        """Unplaceable models that would fit on any of their profiles once this replica alone stops.

        None of them fits now, so only the freed nodes can make a single-node
        shape fit, and only a freed node's fabric a multi-node one: `place`
        runs on those nodes plus that fabric's whole nodes, not the fleet.
        """
        if not freed or not self.unplaceable:
            return []
        nearby = {node.name: node for node in freed}
        for fabric in {node.fabric for node in freed if node.fabric}:
            for node in self.whole_on_fabric.get((holding.gpu_class, fabric), []):
                nearby.setdefault(node.name, node)
        return sorted(
            model
            for model, shapes in self.unplaceable.items()
            if any(
                s.gpu_class == holding.gpu_class and isinstance(place(nearby.values(), s), Placement) for s in shapes
            )
        )


def _entry(holding: Occupant, fleet: _Fleet) -> StopCandidate:
    freed = fleet.after_stopping(holding)
    return StopCandidate(
        replica=holding.replica_id,
        model=holding.model,
        gpu_class=holding.gpu_class,
        gpus=holding.gpu_count,
        nodes=sorted(holding.gpus),
        idle_seconds=round(holding.idle_seconds or 0.0, 3),
        idle=str(Idle(holding.idle_seconds)),
        frees=fleet.frees(holding, freed),
        unblocks=fleet.unblocks(holding, freed),
    )


def what_can_i_stop(
    now: datetime,
    *,
    leader: Leader | None,
    gpu_classes: Iterable[str],
    unplaceable: set[str],
    records: Mapping[str, Iterable[NodeCapacity]],
) -> WhatCanIStop:
    """The summary's `usage`, `idle_held_gpus` and `stoppable` (ranked, best first).

    `gpu_classes` are the fleet's classes (each listed in `idle_held_gpus`),
    `unplaceable` the models with a pending replica that found no room,
    `records` per class the placer's record of each ready, schedulable node.
    Queries: 1 when usage is unknown; else up to 1 + 3 (occupants) + 2 (spare
    replicas) + 1 (sleepers) + 1 (profiles of unplaceable models).
    """
    usage = usage_state(now, leader)
    if not usage.known:
        return WhatCanIStop(usage, idle_held_gpus([], gpu_classes), [])
    occupants = read_occupants(now)
    held = idle_held_gpus(occupants, gpu_classes)
    candidates = stop_candidates(
        occupants, spare_replicas(), min_idle=settings.LLMGW_EVICT_MIN_IDLE_SECONDS, min_residency=0
    )
    sleepers = _sleepers(now)
    if not candidates:
        return WhatCanIStop(usage, held, sleepers)
    fleet = _Fleet(records, _unplaceable_shapes(unplaceable))
    # Most GPU-seconds held while idle first; `candidates` is in eviction order, and sorted() is stable.
    ranked = sorted(candidates, key=lambda h: -(h.gpu_count * (h.idle_seconds or 0.0)))
    return WhatCanIStop(usage, held, [_entry(h, fleet) for h in ranked] + sleepers)


def _sleepers(now: datetime) -> list[StopCandidate]:
    """Asleep replicas known idle, longest idle first, after the GPU holders: stopping one frees no GPU, but the
    host memory a level-1 sleep holds, and its engine process and port. One query."""
    rows = (
        Shard.objects.filter(replica__state=ReplicaState.SLEEPING, replica__last_used__isnull=False)
        .order_by("replica__last_used", "replica_id", "rank")
        .values_list(
            "replica_id", "replica__model__name", "replica__profile__gpu_class", "replica__last_used",
            "replica__sleeping_level", "replica__weights_bytes", "node__name",
        )
    )  # fmt: skip
    found: dict[int, StopCandidate] = {}
    for replica_id, model, gpu_class, last_used, level, weights, node in rows:
        if replica_id in found:
            found[replica_id].nodes.append(node)
            continue
        assert last_used is not None  # the query's filter
        idle = max(0.0, (now - last_used).total_seconds())
        held = f"{weights / (1 << 30):.1f} GiB of host memory" if level == 1 and weights else "no host memory"
        found[replica_id] = StopCandidate(
            replica=replica_id, model=model, gpu_class=gpu_class, gpus=0, nodes=[node],
            idle_seconds=round(idle, 3), idle=str(Idle(idle)), unblocks=[],
            frees=f"{held}, its engine process and port (asleep at level {level or '?'}; no GPU)",
        )  # fmt: skip
    return list(found.values())
