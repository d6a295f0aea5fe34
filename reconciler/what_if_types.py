"""The planner's answer ("Will it fit?"): one typed value per model, with its JSON and text forms, defined once.

`reconciler.what_if` builds it; `manage.py plan`, `POST /api/v1/plan` and the
dashboard's form render it (JSON here, text here, HTML from the same fields).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Verdict(StrEnum):
    """What the planner says of one model (or of one profile of it)."""

    FITS = "fits"
    FITS_AFTER_STOPPING = "fits_after_stopping"
    DOES_NOT_FIT = "does_not_fit"


class Problem(StrEnum):
    """Why a profile does not fit: its memory, the GPU count of the class's nodes, the fabric, or no room now."""

    MEMORY = "memory"
    GPU_COUNT = "gpu_count"
    FABRIC = "fabric"
    ROOM = "room"


@dataclass(frozen=True)
class Spot:
    """Where one shard would go: a node and the GPU indices it would get there (rank 0 first)."""

    node: str
    gpus: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "gpus": list(self.gpus)}


@dataclass(frozen=True)
class Stop:
    """A replica the plan would stop, and what stopping it frees."""

    replica: int
    model: str
    priority: int
    gpu_class: str
    gpus: dict[str, tuple[int, ...]]
    idle_seconds: float
    frees: str

    def to_json(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "model": self.model,
            "priority": self.priority,
            "gpu_class": self.gpu_class,
            "gpu_count": sum(len(indices) for indices in self.gpus.values()),
            "nodes": {node: list(indices) for node, indices in sorted(self.gpus.items())},
            "idle_seconds": round(self.idle_seconds, 3),
            "frees": self.frees,
        }


@dataclass(frozen=True)
class Figures:
    """A profile's memory per GPU on its class (None: not known), and the verdict's sentence with the numbers."""

    needs_gib_per_gpu: float | None = None
    usable_gib_per_gpu: float | None = None
    full_length_sequences: int | None = None
    size_known: bool = False
    memory: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "needs_gib_per_gpu": self.needs_gib_per_gpu,
            "usable_gib_per_gpu": self.usable_gib_per_gpu,
            "full_length_sequences": self.full_length_sequences,
            "size_known": self.size_known,
            "memory": self.memory,
        }


@dataclass(frozen=True)
class ProfileAnswer:
    """One profile of a model as the plan saw it; `verdict` None = not tried (an earlier profile works)."""

    index: int
    shape: str
    figures: Figures
    verdict: Verdict | None = None
    problem: Problem | None = None
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "shape": self.shape,
            **self.figures.to_json(),
            "verdict": None if self.verdict is None else str(self.verdict),
            "problem": None if self.problem is None else str(self.problem),
            "reason": self.reason,
        }


@dataclass(frozen=True)
class ModelAnswer:
    """One model's answer: the verdict, the first profile that works, where it would go and what would stop."""

    name: str
    verdict: Verdict
    profile: int | None
    figures: Figures
    where: list[Spot] = field(default_factory=list)
    stop: list[Stop] = field(default_factory=list)
    reason: str = ""
    profiles: list[ProfileAnswer] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        chosen = None if self.profile is None else self.profiles[self.profile]
        return {
            "name": self.name,
            "verdict": str(self.verdict),
            "profile": self.profile,
            "shape": None if chosen is None else chosen.shape,
            **self.figures.to_json(),
            "where": [spot.to_json() for spot in self.where],
            "stop": [stop.to_json() for stop in self.stop],
            "reason": self.reason,
            "profiles": [p.to_json() for p in self.profiles],
        }

    def lines(self) -> list[str]:
        """The operator's block for this model (text output of `manage.py plan`)."""
        words = {Verdict.FITS: "fits", Verdict.FITS_AFTER_STOPPING: "fits after stopping"}
        head = f"{self.name}: {words.get(self.verdict, 'does not fit')}"
        if self.profile is not None:
            head += f" on profiles[{self.profile}] {self.profiles[self.profile].shape}"
        lines = [head]
        if self.profile is not None:
            lines.append(f"  memory: {self.figures.memory or '-'}")
        if self.where:
            lines.append("  where: " + "; ".join(f"{s.node} GPUs {','.join(map(str, s.gpus))}" for s in self.where))
        for stop in self.stop:
            lines.append(f"  stop: replica {stop.replica} of {stop.model} (frees {stop.frees})")
        for answer in self.profiles:
            if answer.verdict is Verdict.DOES_NOT_FIT:
                lines.append(f"  profiles[{answer.index}] {answer.shape}: {answer.problem}: {answer.reason}")
        return lines


@dataclass(frozen=True)
class PlanAnswer:
    """Every model's answer, in the order asked (each planned as if the ones before it had been placed)."""

    models: list[ModelAnswer]
    usage_known: bool = True
    usage_reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "models": [m.to_json() for m in self.models],
            "usage_known": self.usage_known,
            "usage_reason": self.usage_reason,
        }
