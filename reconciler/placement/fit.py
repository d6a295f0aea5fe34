"""Placement's memory check (DESIGN "Placement's memory check"): which nodes' GPUs can hold a profile.

A profile whose estimated need per GPU (catalog/memory.py, from the best
source catalog/sizing.py finds) exceeds the usable memory of a node's GPUs is
not placed on that node; when no node of its GPU class can hold it, the
profile is refused with the verdict's sentence, numbers included, and the
next profile is tried. A size that is not known, or a node whose GPU memory
is not reported, leaves placement as it was: counting GPUs only.

Models whose source the control plane cannot read (hub ids) are sized by the
headers agents report with their weights: the tick reads them with the
weights on disk it already reads for placement (reconciler/placement/placer.py), so
they cost no query of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from catalog.memory import MIB, Fit, GPUMemory, MemoryVerdict, ProfileMemory, judge
from catalog.models import Profile
from catalog.sizing import ReportedWeights, profile_memory
from reconciler.placement.search import NodeCapacity


class Records(Protocol):
    """Where the placer's view of the nodes comes from: a tick's capacity snapshot, or a plan's fleet."""

    def records(self, gpu_class: str) -> list[NodeCapacity]: ...

    def memory_sizes(self, gpu_class: str) -> frozenset[int]:
        """The GPU memory sizes (MiB) of the class's nodes: fixed while GPUs are taken and freed."""
        ...


class MemoryCheck:
    """One tick's memory verdicts: each profile's estimate made once, judged once per GPU memory size.


    `reported` is what agents report of the weights of every profile the tick may judge, by weights key
    (catalog.sizing.reported_weights); without it each estimate of a hub model reads its own. Profiles are
    told apart by id when saved, else by the row object itself (the planner judges unsaved rows, whose ids
    are all None).
    """

    def __init__(self, reported: Mapping[str, ReportedWeights] | None = None) -> None:
        self._estimates: dict[tuple, ProfileMemory | None] = {}
        self._verdicts: dict[tuple, MemoryVerdict | None] = {}
        self._unsaved: dict[int, Profile] = {}  # kept alive, so the id() keys of unsaved rows are never reused
        self._reported = reported

    def _key(self, profile: Profile) -> tuple:
        if profile.pk is not None:
            return ("pk", profile.pk)
        self._unsaved.setdefault(id(profile), profile)
        return ("row", id(profile))

    def verdict(self, profile: Profile, memory_mib: int) -> MemoryVerdict | None:
        """`profile` on GPUs of its class with `memory_mib` MiB each; None when the memory is not reported."""
        if memory_mib <= 0:
            return None
        key = (*self._key(profile), memory_mib)
        if key not in self._verdicts:
            estimate = self._estimate(profile)
            self._verdicts[key] = (
                None if estimate is None else judge(estimate, GPUMemory(profile.gpu_class, memory_mib * MIB))
            )
        return self._verdicts[key]

    def _estimate(self, profile: Profile) -> ProfileMemory | None:
        key = self._key(profile)
        if key not in self._estimates:
            try:
                self._estimates[key] = profile_memory(profile, self._reported)
            except ValueError:
                self._estimates[key] = None  # an engine the memory model does not know: count GPUs only
        return self._estimates[key]

    def holds(self, profile: Profile, node: NodeCapacity) -> bool:
        """Whether `node`'s GPUs may hold `profile` (yes when either the size or the memory is unknown)."""
        return self._holds_size(profile, node.memory_mib)

    def records(self, capacity: Records, profile: Profile) -> list[NodeCapacity]:
        """The nodes of `profile`'s GPU class whose GPUs can hold it, as the placer sees them now.

        Judged once per GPU memory size of the class, not once per node: the placer asks for every
        replica it places, and a fleet has thousands of nodes but a handful of sizes."""
        nodes = capacity.records(profile.gpu_class)
        fits = {size: self._holds_size(profile, size) for size in capacity.memory_sizes(profile.gpu_class)}
        if all(fits.values()):
            return nodes
        return [node for node in nodes if fits[node.memory_mib]]

    def _holds_size(self, profile: Profile, memory_mib: int) -> bool:
        verdict = self.verdict(profile, memory_mib)
        return verdict is None or verdict.fit is not Fit.DOES_NOT_FIT

    def refusal(self, capacity: Records, profile: Profile) -> str | None:
        """The verdict's sentence when no node of `profile`'s class can hold it, judged on the largest
        GPUs of the class (e.g. "needs 74.2 GiB per GPU; L40S-48GB has 44.7 GiB usable ..."); else None."""
        nodes = capacity.records(profile.gpu_class)
        if not nodes or any(self.holds(profile, node) for node in nodes):
            return None
        largest = max(node.memory_mib for node in nodes)
        verdict = self.verdict(profile, largest)
        return None if verdict is None else verdict.sentence

    def weights_bytes(self, profile: Profile) -> int | None:
        """The profile's weights in bytes as this tick's estimate has them; None when not known."""
        estimate = self._estimate(profile)
        return None if estimate is None else estimate.weights.bytes
