"""The planner's answer ("Will it fit?"): typed values defined once, their JSON is `dataclasses.asdict`.

`reconciler.planner.what_if` builds them; `manage.py plan`, `POST /api/v1/plan` (whose
OpenAPI schema is derived from these dataclasses) and the dashboard's form
render them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class Verdict(StrEnum):
    """What the planner says of one model (or of one profile of it)."""

    FITS = "fits"
    FITS_AFTER_STOPPING = "fits_after_stopping"
    DOES_NOT_FIT = "does_not_fit"


class Problem(StrEnum):
    """Why a profile does not fit: its own max replicas, its memory, the GPU count of the class's nodes, the
    fabric, or no room now."""

    MAX_REPLICAS = "max_replicas"
    MEMORY = "memory"
    GPU_COUNT = "gpu_count"
    FABRIC = "fabric"
    ROOM = "room"


@dataclass(frozen=True)
class Spot:
    """Where one shard would go: a node and the GPU indices it would get there (rank 0 first)."""

    node: str
    gpus: list[int]


@dataclass(frozen=True)
class Stop:
    """A replica the plan would stop, and what stopping it frees."""

    replica: int
    model: str
    priority: int
    gpu_class: str
    gpu_count: int
    nodes: dict[str, list[int]]
    """Node name -> the GPU indices it holds there."""
    idle_seconds: float
    frees: str
    sleeps: bool = False
    """The tick would put it to sleep rather than stop it (the hibernate tier): it wakes in seconds later."""
    after_seconds: float | None = 0.0
    """Seconds until it may be stopped (not idle or resident long enough yet; the tick holds requests until
    then); None while it runs requests, which no clock ends; 0: now."""

    def when(self) -> str:
        """When it may be stopped, for the text answer: "" when now."""
        if self.after_seconds is None:
            return ", once its requests in flight finish"
        return f", in {self.after_seconds:.0f} s" if self.after_seconds else ""


@dataclass(frozen=True, kw_only=True)
class Figures:
    """A profile's memory per GPU on its class (None: not known), and the verdict's sentence with the numbers."""

    needs_gib_per_gpu: float | None = None
    usable_gib_per_gpu: float | None = None
    full_length_sequences: int | None = None
    size_known: bool = False
    memory: str = ""

    def figures(self) -> dict[str, Any]:
        """Just these fields (to copy them onto another answer)."""
        return {name: getattr(self, name) for name in Figures.__dataclass_fields__}


@dataclass(frozen=True, kw_only=True)
class ProfileAnswer(Figures):
    """One profile of a model as the plan saw it; `verdict` None = not tried (an earlier profile works)."""

    index: int
    shape: str
    verdict: Verdict | None = None
    problem: Problem | None = None
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class ModelAnswer(Figures):
    """One model's answer: the verdict, the first profile that works, where it would go and what would stop.

    The figures are the chosen profile's (judged on the GPUs it would get), else the first profile's.
    """

    name: str
    verdict: Verdict
    profile: int | None = None
    shape: str | None = None
    where: list[Spot] = field(default_factory=list)
    stop: list[Stop] = field(default_factory=list)
    reason: str = ""
    profiles: list[ProfileAnswer] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The operator's block for this model (text output of `manage.py plan`)."""
        words = {Verdict.FITS: "fits", Verdict.FITS_AFTER_STOPPING: "fits after stopping"}
        head = f"{self.name}: {words.get(self.verdict, 'does not fit')}"
        lines = [head if self.profile is None else f"{head} on profiles[{self.profile}] {self.shape}"]
        if self.profile is not None:
            lines.append(f"  memory: {self.memory or '-'}")
        if self.where:
            lines.append("  where: " + "; ".join(f"{s.node} GPUs {','.join(map(str, s.gpus))}" for s in self.where))
        for stop in self.stop:
            how = "sleep" if stop.sleeps else "stop"
            lines.append(f"  {how}: replica {stop.replica} of {stop.model} (frees {stop.frees}){stop.when()}")
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
    """Why nothing counts as idle (so nothing would be stopped) when usage is not known."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
