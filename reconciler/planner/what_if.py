"""What if: would these models fit the fleet now, where, and what would have to stop (DESIGN "Will it fit?").

The planner reads what the tick reads and decides the way the tick decides,
writing nothing: the free-capacity snapshot (`capacity.free_capacity`), the
memory check (`fit.MemoryCheck`), the placer (`placement.place` on the nodes
whose GPUs can hold the profile, preferring nodes with the weights on disk),
and for room the one eviction order (`eviction.stop_candidates` over
`occupants.read_occupants`, then `eviction.plan_eviction`) with the tick's own
rules (`room.make_room`): never the model's own replicas, never busy, never
below a model's min replicas, priority at most the model's first profile's
(the profile its new replicas are made on), idle and resident long enough.

Per model, like the tick: the first profile with room now (`fits`); else the
first profile that stopping candidates makes room for (`fits_after_stopping`);
else `does_not_fit`, with each profile's reason. Models are planned in the
order given and cumulatively: each sees the GPUs of the ones before it as
taken, and their victims as already stopped (and no longer candidates).

A constant number of queries whatever the fleet size or the number of models.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db.models import Count, Prefetch, Q
from django.utils import timezone

from catalog.catalog_file import read_models
from catalog.models import Model, Profile
from catalog.sizing import class_memory_mib, shape_words
from nodewire.weights.disk import weights_key
from reconciler.choices import ReplicaState
from reconciler.demand.usage import FLEET
from reconciler.models import Replica, UsageWatch
from reconciler.placement.capacity import CapacitySnapshot, free_capacity
from reconciler.placement.eviction import (
    Occupant,
    others_than,
    plan_eviction,
    seconds_until_stoppable,
    stop_candidates,
    with_freed,
)
from reconciler.placement.fit import MemoryCheck
from reconciler.placement.occupants import read_occupants, sleep_levels, spare_replicas
from reconciler.placement.placer import weights_on_disk
from reconciler.placement.search import NodeCapacity, Placement, Shape, place
from reconciler.planner.answer import Figures, ModelAnswer, PlanAnswer, Problem, ProfileAnswer, Spot, Stop, Verdict

BY_COUNT = "judged by GPU count alone"


class PlanInputError(Exception):
    """What was asked cannot be planned; `messages` names every problem (a file's field, an unknown name).

    `part` says which part of the request they are about: "models" (the
    catalog-format entries), "names" (catalog models), or None (the whole request).
    """

    def __init__(self, messages: list[str], part: str | None = None):
        self.messages = list(messages)
        self.part = part
        super().__init__("\n".join(self.messages))


@dataclass(frozen=True)
class PlanEntry:
    """A model to plan: its name and its profiles in the order they are tried (unsaved rows for a file's entry)."""

    name: str
    profiles: list[Profile]


def entries_from_data(data: Any) -> list[PlanEntry]:
    """The models of a parsed catalog file (`models:` entries, checked as `catalog apply` checks them). No query."""
    problems: list[str] = []
    wanted = read_models(data, problems)
    if problems:
        raise PlanInputError(problems, "models")
    entries = []
    for item in wanted:
        model = Model(name=item.name, source=item.source, enabled=item.enabled, **item.size)
        entries.append(
            PlanEntry(item.name, [Profile(model=model, order=i, **fields) for i, fields in enumerate(item.profiles)])
        )
    return entries


def entries_from_names(names: list[str]) -> list[PlanEntry]:
    """Catalog models by name or alias, in the order given; unknown names are one PlanInputError. Three queries."""
    profiles = Profile.objects.order_by("order", "id")
    models = Model.objects.filter(Q(name__in=names) | Q(aliases__name__in=names)).distinct()
    found: dict[str, Model] = {}
    for model in models.prefetch_related("aliases", Prefetch("profiles", queryset=profiles)):
        found[model.name] = model
        for alias in model.aliases.all():
            found.setdefault(alias.name, model)
    unknown = [name for name in names if name not in found]
    if unknown:
        raise PlanInputError([f"no catalog model or alias named {name!r}" for name in unknown], "names")
    return [PlanEntry(found[name].name, list(found[name].profiles.all())) for name in names]


def plan_request(data: Any = None, names: list[str] | None = None, now: datetime | None = None) -> PlanAnswer:
    """Plan a catalog file's models (`data`, parsed) then catalog models by name, in that order; PlanInputError
    naming every problem when nothing or something wrong is asked. What `manage.py plan` and the API call."""
    entries = entries_from_data(data) if data is not None else []
    if names:
        entries += entries_from_names(names)
    if not entries:
        raise PlanInputError(["nothing to plan: give catalog-format model entries or catalog model names"])
    return plan(entries, now or timezone.now())


def plan(entries: list[PlanEntry], now: datetime) -> PlanAnswer:
    """Each entry's answer, planned in order and cumulatively (module docstring). Writes nothing.

    Queries: 1 (usage) + 3 (free capacity) + 1 (weights on disk), + 1 (replicas
    per profile) when catalog models are asked about, and when some model needs
    room: 3 (occupants) + 2 (spare replicas).
    """
    watch = UsageWatch.objects.filter(name=FLEET).first()
    known = watch is not None and watch.known_since is not None
    reason = (
        "" if known else (watch.reason if watch is not None and watch.reason else "no tick has collected usage yet")
    )
    keys = {weights_key(p.engine, p.model.source) for entry in entries for p in entry.profiles}
    holders, reported = weights_on_disk(keys) if keys else ({}, {})
    planner = _Planner(_Fleet(free_capacity(now)), holders, known, now, MemoryCheck(reported))
    planner.running = _running_per_profile(entries)
    return PlanAnswer([planner.answer(entry) for entry in entries], known, reason)


def _running_per_profile(entries: list[PlanEntry]) -> dict[int, int]:
    """Replicas on each saved profile asked about, counted as placing counts them for a profile's own max.
    One query when a catalog model is asked about, none for a file's entries (their profiles are not saved)."""
    ids = {p.pk for entry in entries for p in entry.profiles if p.pk is not None}
    if not ids:
        return {}
    rows = (
        Replica.objects.filter(profile_id__in=ids, drain_deadline__isnull=True)
        .exclude(state__in=(ReplicaState.PENDING, ReplicaState.STOPPING))
        .values("profile_id")
        .annotate(n=Count("id"))
        .values_list("profile_id", "n")
    )
    return dict(rows)


class _Fleet:
    """The snapshot's placer records as the plan goes: GPUs of earlier answers taken, their victims' GPUs freed."""

    def __init__(self, snapshot: CapacitySnapshot):
        self.snapshot = snapshot
        self._nodes = {c: {r.name: r for r in snapshot.records(c)} for c in list(snapshot.nodes)}

    def records(self, gpu_class: str) -> list[NodeCapacity]:
        return list(self._nodes.get(gpu_class, {}).values())

    def memory_sizes(self, gpu_class: str) -> frozenset[int]:
        return self.snapshot.memory_sizes(gpu_class) if gpu_class in self.snapshot.nodes else frozenset()

    def node(self, gpu_class: str, name: str) -> NodeCapacity | None:
        return self._nodes.get(gpu_class, {}).get(name)

    def largest_memory_mib(self, gpu_class: str) -> int:
        return max((r.memory_mib for r in self.records(gpu_class)), default=0)

    def free(self, victims: list[Occupant]) -> None:
        for gpu_class in {v.gpu_class for v in victims}:
            for record in with_freed(self.records(gpu_class), victims):
                self._nodes[gpu_class][record.name] = record

    def take(self, gpu_class: str, placement: Placement) -> None:
        for shard in placement.shards:
            record = self._nodes[gpu_class][shard.node]
            free = tuple(i for i in record.free if i not in shard.gpu_indices)
            self._nodes[gpu_class][shard.node] = replace(record, free=free)


class _Planner:
    """One request's plan: the fleet as earlier answers left it, and the victims already chosen."""

    def __init__(
        self, fleet: _Fleet, holders: dict[str, frozenset[str]], usage_known: bool, now: datetime, memory: MemoryCheck
    ):
        self.fleet, self.holders, self.usage_known, self.now = fleet, holders, usage_known, now
        self.memory = memory
        self.occupants: list[Occupant] | None = None  # read once, when a model first needs room
        self.levels: dict[int, int] = {}  # the level each holding would sleep at (0: it would be stopped)
        self.spare: dict[str, int] = {}
        self.taken: set[int] = set()
        self.running: dict[int, int] = {}  # replicas per saved profile, for its own max

    def answer(self, entry: PlanEntry) -> ModelAnswer:
        """The tick's two passes: room now on the profiles in order, then room made by stopping, in order."""
        answers = {i: self._unchecked(i, p) for i, p in enumerate(entry.profiles)}
        no_room: dict[int, str] = {}
        for i, profile in enumerate(entry.profiles):
            blocked = self._blocked(profile)
            if blocked is not None:
                answers[i] = replace(answers[i], verdict=Verdict.DOES_NOT_FIT, problem=blocked[0], reason=blocked[1])
                continue
            holders = self.holders.get(weights_key(profile.engine, profile.model.source), frozenset())
            result = place(self.memory.records(self.fleet, profile), Shape.of(profile), holders)
            if isinstance(result, Placement):
                return self._chosen(entry, i, answers, Verdict.FITS, result, [])
            no_room[i] = result.reason
        for i, reason in no_room.items():
            profile = entry.profiles[i]
            victims, made, why_not = self._room(entry, profile)
            if made is not None:
                return self._chosen(entry, i, answers, Verdict.FITS_AFTER_STOPPING, made, victims)
            answers[i] = replace(
                answers[i], verdict=Verdict.DOES_NOT_FIT, problem=Problem.ROOM, reason=f"{reason}; {why_not}"
            )
        listed = [answers[i] for i in sorted(answers)]
        reasons = [f"profiles[{a.index}] {a.shape}: {a.reason}" for a in listed] or ["the model has no profiles"]
        figures = listed[0].figures() if listed else {}
        if listed and not listed[0].size_known:
            reasons.append(f"{BY_COUNT}: {listed[0].memory}")
        return ModelAnswer(
            name=entry.name, verdict=Verdict.DOES_NOT_FIT, reason="; ".join(reasons), profiles=listed, **figures
        )

    def _unchecked(self, index: int, profile: Profile) -> ProfileAnswer:
        """A profile's shape and memory figures on its class's largest GPUs, before any verdict."""
        memory = self.fleet.largest_memory_mib(profile.gpu_class) or class_memory_mib(profile.gpu_class, {}) or 0
        return ProfileAnswer(index=index, shape=shape_words(profile), **self._figures(profile, memory).figures())

    def _figures(self, profile: Profile, memory_mib: int) -> Figures:
        judged = self.memory.verdict(profile, memory_mib)
        if judged is None:
            known = "not known (no agent reports it)" if memory_mib <= 0 else f"{memory_mib} MiB"
            return Figures(memory=f"no verdict: the memory of GPU class {profile.gpu_class} is {known}")
        return Figures(
            needs_gib_per_gpu=judged.needs_gib,
            usable_gib_per_gpu=judged.usable_gib,
            full_length_sequences=judged.sequences,
            size_known=judged.needs_bytes is not None,
            memory=judged.sentence,
        )

    def _blocked(self, profile: Profile) -> tuple[Problem, str] | None:
        """Why `profile` cannot take a replica whatever is stopped: its own max, its memory, GPU count or fabric."""
        gpu_class, per_node, nodes_needed = profile.gpu_class, profile.gpus_per_node, profile.nodes_per_replica
        if profile.pk is not None and self.running.get(profile.pk, 0) >= profile.max_replicas:
            return (
                Problem.MAX_REPLICAS,
                f"at its max of {profile.max_replicas} replica(s): the tick places no more on it",
            )
        nodes = self.fleet.records(gpu_class)
        if not nodes:
            # The tick's own words: which nodes of the class are out of service, or that none has it.
            return Problem.GPU_COUNT, self.fleet.snapshot.without_class(gpu_class)
        refusal = self.memory.refusal(self.fleet, profile)
        if refusal is not None:
            return Problem.MEMORY, refusal
        holding = [n for n in nodes if self.memory.holds(profile, n)]
        big = [n for n in holding if n.total >= per_node]
        if not big:
            most = max(n.total for n in holding)
            return Problem.GPU_COUNT, f"needs {per_node} {gpu_class} GPUs on one node; the most on one node: {most}"
        if nodes_needed > 1:
            per_fabric = Counter(n.fabric for n in big if n.fabric)
            if max(per_fabric.values(), default=0) < nodes_needed:
                counts = ", ".join(f"{count} on {fabric}" for fabric, count in sorted(per_fabric.items())) or "none"
                return Problem.FABRIC, (
                    f"needs {nodes_needed} {gpu_class} nodes of {per_node}+ GPUs on one fabric; there are {counts}"
                )
        return None

    def _room(self, entry: PlanEntry, profile: Profile) -> tuple[list[Occupant], Placement | None, str]:
        """The fewest candidates to stop for `profile`, as `room.make_room` picks them; else why none."""
        if not self.usage_known:
            return [], None, "usage is unknown, so nothing counts as idle and nothing would be stopped"
        if self.occupants is None:
            self.occupants, self.spare = read_occupants(self.now), spare_replicas()
            self.levels = sleep_levels([h.replica_id for h in self.occupants])
        records, shape = self.memory.records(self.fleet, profile), Shape.of(profile)
        candidates = self._candidates(entry, soon=False)
        found = plan_eviction(records, shape, candidates)
        if found is None:
            # Hold, don't refuse (reconciler.placement.room): the tick holds requests for room replicas will make once
            # they become evictable, and stops them then.
            found = plan_eviction(records, shape, self._candidates(entry, soon=True))
        if found is None:
            which = f"{len(candidates)} replica{'' if len(candidates) == 1 else 's'} may be stopped"
            return [], None, f"stopping what may be stopped would not make room ({which})"
        return found[0], found[1], ""

    def _candidates(self, entry: PlanEntry, *, soon: bool) -> list[Occupant]:
        assert self.occupants is not None
        return stop_candidates(
            others_than(entry.name, self.occupants, self.taken),
            self.spare,
            min_idle=settings.LLMGW_EVICT_MIN_IDLE_SECONDS,
            min_residency=settings.LLMGW_MIN_RESIDENCY_SECONDS,
            max_priority=entry.profiles[0].priority,
            soon=soon,
        )

    def _chosen(
        self,
        entry: PlanEntry,
        index: int,
        answers: dict[int, ProfileAnswer],
        verdict: Verdict,
        placement: Placement,
        victims: list[Occupant],
    ) -> ModelAnswer:
        """Commit the answer to the plan's fleet (victims freed, GPUs taken) and describe it."""
        profile = entry.profiles[index]
        self.fleet.free(victims)
        stops = [self._stop(victim) for victim in victims]
        for victim in victims:
            self.taken.add(victim.replica_id)
            self.spare[victim.model] -= 1
        self.fleet.take(profile.gpu_class, placement)
        spots = [Spot(s.node, list(s.gpu_indices)) for s in placement.shards]
        where = [self.fleet.node(profile.gpu_class, s.node) for s in placement.shards]
        memory = min((n.memory_mib for n in where if n is not None and n.memory_mib), default=0)
        figures = self._figures(profile, memory) if memory else answers[index]
        answers[index] = replace(answers[index], verdict=verdict, **figures.figures())
        listed = [answers[i] for i in sorted(answers)]
        return ModelAnswer(
            name=entry.name,
            verdict=verdict,
            profile=index,
            shape=listed[index].shape,
            where=spots,
            stop=stops,
            reason="" if figures.size_known else f"{BY_COUNT}: {figures.memory}",
            profiles=listed,
            **figures.figures(),
        )

    def _stop(self, victim: Occupant) -> Stop:
        """A victim and what it frees, on the fleet with this answer's victims freed (before its GPUs are taken)."""
        phrases = []
        for name, indices in sorted(victim.gpus.items()):
            count = f"{len(indices)} {victim.gpu_class} GPU{'' if len(indices) == 1 else 's'} on {name}"
            record = self.fleet.node(victim.gpu_class, name)
            if record is None:
                count += " (not schedulable now)"
            elif record.whole:
                count += f" (the whole node{f', fabric {record.fabric}' if record.fabric else ''})"
            phrases.append(count)
        idle = round(victim.idle_seconds or 0.0, 3)
        frees = ", ".join(phrases) or "nothing schedulable"
        after = seconds_until_stoppable(
            [victim], min_idle=settings.LLMGW_EVICT_MIN_IDLE_SECONDS, min_residency=settings.LLMGW_MIN_RESIDENCY_SECONDS
        )
        nodes = {name: list(indices) for name, indices in sorted(victim.gpus.items())}
        return Stop(
            victim.replica_id,
            victim.model,
            victim.priority,
            victim.gpu_class,
            victim.gpu_count,
            nodes,
            idle,
            frees,
            sleeps=bool(self.levels.get(victim.replica_id)),
            after_seconds=None if after is None else round(after, 3),
        )
