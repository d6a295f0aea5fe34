"""What if the load changed: how many replicas would a model need at `factor` times the load the routers see now?

Read from what the tick last recorded (`ModelLoad`, reconciler.demand.objectives) and decided the way objective
scaling decides, writing nothing:

* a model whose first profile sets latency objectives: its worst p90 over its objective (the ratio) on the
  replicas the routers' window saw serving, scaled by `factor`, brought down to LLMGW_OBJECTIVE_SCALE_UP:
  ceil(factor × seen × ratio / up) — latency taken to follow load per replica, as scale-out takes it;
* one without: the requests in flight at `factor` times today's over its target concurrency per replica;

at least its min replicas, and said so when its max replicas would cap it. A model with nothing measured says
that instead of guessing. Three queries whatever the number of models.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from django.conf import settings

from catalog.models import Profile
from reconciler.choices import ReplicaState
from reconciler.demand.objectives import has_objectives, seen_in_window
from reconciler.models import ModelLoad, Replica


@dataclass(frozen=True)
class LoadAnswer:
    """One model's answer: the replicas its load at `factor` times today's would need (None: nothing measured), how
    many it has ready, and the figures the answer rests on in a sentence."""

    model: str
    factor: float
    ready: int
    replicas: int | None
    max_replicas: int
    basis: str

    def line(self) -> str:
        if self.replicas is None:
            return f"{self.model}: {self.basis}"
        capped = f", but its max replicas is {self.max_replicas}" if self.replicas > self.max_replicas else ""
        return (
            f"{self.model}: {self.replicas} replicas at {self.factor:g}× the load of the routers' last window "
            f"({self.ready} ready now{capped}): {self.basis}"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def replicas_for_load(names: list[str], factor: float, now: datetime) -> list[LoadAnswer]:
    """The answer for each catalog model named (names, not aliases: entries_from_names resolves those first)."""
    if not factor > 0:
        raise ValueError(f"the load factor must be above 0, not {factor!r}")
    first: dict[str, Profile] = {}
    for profile in Profile.objects.filter(model__name__in=names).select_related("model").order_by("order", "id"):
        first.setdefault(profile.model.name, profile)
    loads = {load.model.name: load for load in ModelLoad.objects.filter(model__name__in=names).select_related("model")}
    ready: dict[str, list] = {name: [] for name in names}
    for name, since in Replica.objects.filter(model__name__in=names, state=ReplicaState.READY).values_list(
        "model__name", "ready_at"
    ):
        ready[name].append(since)
    return [_answer(first[name], loads.get(name), ready[name], factor, now) for name in names]


def _answer(primary: Profile, load: ModelLoad | None, ready: list, factor: float, now: datetime) -> LoadAnswer:
    name, most = primary.model.name, primary.max_replicas

    def unknown(why: str) -> LoadAnswer:
        return LoadAnswer(name, factor, len(ready), None, most, why)

    if has_objectives(primary):
        ratio, basis = _ratio(primary, load)
        seen = seen_in_window(ready, now, settings.LLMGW_LATENCY_WINDOW_SECONDS)
        if ratio is None:
            return unknown("too few streams in the routers' last window to read a p90")
        if not seen:
            return unknown("no replica served through the routers' last window")
        needed = math.ceil(factor * seen * ratio / settings.LLMGW_OBJECTIVE_SCALE_UP)
        basis += f" on {seen:.2g} replicas serving through the window"
    elif load is not None and load.in_flight:
        needed = math.ceil(factor * load.in_flight / primary.target_concurrency)
        basis = f"{load.in_flight} requests in flight, a target of {primary.target_concurrency} per replica"
    else:
        return unknown("no requests in flight in the routers' last reports")
    return LoadAnswer(name, factor, len(ready), max(needed, primary.min_replicas), most, basis)


def _ratio(primary: Profile, load: ModelLoad | None) -> tuple[float | None, str]:
    """The worst p90 over its objective and the sentence saying so; (None, "") when no p90 was read."""
    if load is None:
        return None, ""
    objectives = [
        ("first token", primary.ttft_objective_seconds, load.ttft_p90),
        ("gap between tokens", primary.itl_objective_seconds, load.itl_p90),
    ]
    measured = [(p90 / objective, what, p90, objective) for what, objective, p90 in objectives if objective and p90]
    if not measured:
        return None, ""
    ratio, what, p90, objective = max(measured)
    return ratio, f"p90 {what} {p90:.3g} s against {objective:.3g} s"
