"""Host memory for level-1 sleepers: how deep each replica going to sleep may sleep, node by node.

A level-1 sleep keeps the replica's weights in its nodes' host memory (each
node holds its share: the weights ÷ the nodes the replica spans). Agents
report each node's host memory; a share `LLMGW_HOST_MEMORY_SLEEP_FRACTION`
of it may be held by level-1 sleepers. A replica that would go over it on any
of its nodes sleeps at level 2 instead (its weights discarded, reloaded from
disk on wake) when its engine can; an engine with level 1 only (SGLang) has
the least recently used level-1 sleepers of those nodes stopped to make room,
or, when even that is not enough, is stopped itself. A node whose host memory
is not reported takes no level-1 sleeper (the budget is unknown, so it is not
spent). Two queries whatever the number of replicas.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings

from catalog.choices import ENGINE_SLEEP_LEVELS, SleepLevel
from reconciler.choices import ReplicaState
from reconciler.models import Shard

MIB = 1 << 20


@dataclass
class _Sleeper:
    replica_id: int
    share: int  # bytes held on each of its nodes
    last_used: datetime | None  # None: unknown, or put to sleep by this very call


@dataclass
class HostBudget:
    """Per node: bytes level-1 sleepers may hold, and the sleepers holding them now (least recently used first)."""

    budget: dict[int, int | None] = field(default_factory=dict)  # None: host memory not reported
    held: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    sleepers: dict[int, list[_Sleeper]] = field(default_factory=lambda: defaultdict(list))

    def fits(self, nodes: list[int], share: int) -> bool:
        return all((budget := self.budget.get(n)) is not None and self.held[n] + share <= budget for n in nodes)

    def take(self, replica_id: int, nodes: list[int], share: int) -> None:
        for node in nodes:
            self.held[node] += share
            self.sleepers[node].append(_Sleeper(replica_id, share, None))

    def evict_for(self, nodes: list[int], share: int) -> list[int] | None:
        """The least recently used level-1 sleepers whose stop makes `share` fit on every node of `nodes`, taken
        out of the budget; None when stopping them all would not do. Never one whose last use is unknown
        (DESIGN invariant 3), nor one this very call has just put to sleep."""
        budgets = {n: self.budget.get(n) for n in nodes}
        known = {n: b for n, b in budgets.items() if b is not None}
        if len(known) < len(budgets) or any(share > b for b in known.values()):
            return None
        victims: dict[int, _Sleeper] = {}
        for node in nodes:
            on_node = self.sleepers[node]
            room = known[node] - self.held[node] + sum(s.share for s in on_node if s.replica_id in victims)
            used = [(s.last_used, s) for s in on_node if s.last_used is not None]
            for _, sleeper in sorted(used, key=lambda pair: pair[0]):
                if room >= share:
                    break
                if sleeper.replica_id not in victims:
                    victims[sleeper.replica_id] = sleeper
                    room += sleeper.share
            if room < share:
                return None
        for node, on_node in self.sleepers.items():
            self.held[node] -= sum(s.share for s in on_node if s.replica_id in victims)
            self.sleepers[node] = [s for s in on_node if s.replica_id not in victims]
        return list(victims)


def choose_levels(wanted: dict[int, int]) -> tuple[dict[int, int], list[int]]:
    """For replicas going to sleep ({replica id: the best level its engine was started for}), the level each
    sleeps at, and the level-1 sleepers to stop to make room for them. A replica given level 0 is to be stopped."""
    offload = [pk for pk, level in wanted.items() if level == SleepLevel.OFFLOAD]
    levels = dict(wanted)
    if not offload:
        return levels, []
    mine: dict[int, list[int]] = defaultdict(list)
    share: dict[int, int | None] = {}
    engine: dict[int, str] = {}
    budget = HostBudget()
    fraction = settings.LLMGW_HOST_MEMORY_SLEEP_FRACTION
    for replica_id, node_id, host_mib, weights, spans, engine_name in Shard.objects.filter(
        replica_id__in=offload
    ).values_list(
        "replica_id",
        "node_id",
        "node__reported_host_memory_mib",
        "replica__weights_bytes",
        "replica__profile__nodes_per_replica",
        "replica__profile__engine",
    ):
        mine[replica_id].append(node_id)
        share[replica_id] = None if weights is None else -(-weights // max(spans, 1))
        engine[replica_id] = engine_name
        budget.budget[node_id] = None if not host_mib else int(host_mib * MIB * fraction)
    for node_id, replica_id, weights, spans, last_used in Shard.objects.filter(
        node_id__in=list(budget.budget),
        replica__state=ReplicaState.SLEEPING,
        replica__sleeping_level=SleepLevel.OFFLOAD,
    ).values_list(
        "node_id", "replica_id", "replica__weights_bytes", "replica__profile__nodes_per_replica", "replica__last_used"
    ):
        held = -(-(weights or 0) // max(spans, 1))
        budget.held[node_id] += held
        budget.sleepers[node_id].append(_Sleeper(replica_id, held, last_used))
    stop: list[int] = []
    for pk in offload:
        nodes, bytes_ = mine.get(pk, []), share.get(pk)
        if bytes_ is not None and budget.fits(nodes, bytes_):
            budget.take(pk, nodes, bytes_)
            continue
        if SleepLevel.DISCARD in ENGINE_SLEEP_LEVELS.get(engine.get(pk, ""), ()):
            levels[pk] = SleepLevel.DISCARD
            continue
        victims = None if bytes_ is None else budget.evict_for(nodes, bytes_)
        if victims is None:
            levels[pk] = SleepLevel.NEVER
            continue
        stop.extend(victims)
        budget.take(pk, nodes, bytes_)  # type: ignore[arg-type]
    return levels, stop
