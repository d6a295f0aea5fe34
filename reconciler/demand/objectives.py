"""Scaling on what users feel: a profile's latency objectives against the routers' windows (hub.windows).

A profile may set objectives for the p90 of streamed answers' time to first
token (queue wait and holds included) and of the gaps between their tokens.
The tick sums the live routers' windows for the model (`Felt.of`), reads each
p90 from the summed bucket counts, and takes the worst p90 over its objective:
the model's ratio. Its pressure is that ratio with the replicas still starting
discounted, and those ready for less than the window too: the window saw them
serve for part of it only (`seen_in_window`), so pressure = ratio × seen /
(ready + starting). The load they will take is already on its way, so it is
not answered twice — and a p90 taken before they served does not add more.

Replicas take a while to start (the profile's learned `start_seconds`): a load
still rising when one is asked for will have grown by the time it serves. The
ratio is multiplied by that growth (`look_ahead`: the rise of the streams that
began in the window over the last window, projected over the start time), so a
ramp is answered a start ahead instead of a start behind.

The rule (`step`), with hysteresis so a p90 that wavers around its objective
neither adds replicas nor restarts the clock on every wobble:

* the model is over its objectives from the tick its pressure reaches
  LLMGW_OBJECTIVE_SCALE_UP until it falls to LLMGW_OBJECTIVE_SCALE_DOWN;
* once over for LLMGW_SCALE_OUT_AFTER_SECONDS (while replicas it added are still
  starting, for a whole window since the last step: the first tokens that
  waited for them are still in the window), a tick whose pressure is at
  least the up threshold adds the replicas that would bring the ratio down to
  it were latency to follow load per replica (ceil(seen × ratio / up), less
  those ready and starting), at least one and at most as many as are ready
  (doubling at most per step: latency in a queue grows faster than load, so
  the ratio overstates what is missing), up to the model's max;
* with fewer than MIN_OBSERVATIONS first tokens (and gaps) in the window a p90
  says nothing: no reading, not over.

Without objectives the concurrency rule stays (reconciler.demand.scaling).
Scale-in stays idle-based; a calm model parks the replicas it does not need so
they can become idle (reconciler.demand.spares).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime

from catalog.models import Profile
from hub.windows import (
    FIRST_TOKEN_BUCKETS,
    INTER_TOKEN_BUCKETS,
    QUEUE_WAIT_BUCKETS,
    ModelWindow,
    quantile,
    share_within,
)

MIN_OBSERVATIONS = 20
"""Observations a window needs before its p90 is read (a p90 of a handful of streams is noise)."""
P90 = 0.9


def has_objectives(profile: Profile) -> bool:
    return profile.ttft_objective_seconds is not None or profile.itl_objective_seconds is not None


@dataclass(frozen=True)
class Felt:
    """One model's figures over the live routers' windows, against its primary profile's objectives (None: not
    enough seen, or no objective)."""

    ttft_p90: float | None = None
    itl_p90: float | None = None
    ttft_attained: float | None = None
    """Share of first tokens within the TTFT objective."""
    itl_attained: float | None = None
    ratio: float | None = None
    """The worst p90 over its objective; None without an objective or enough observations."""
    streams: int = 0
    """First tokens in the window: the streams that began (the load the look-ahead follows)."""
    queue: dict[str, dict[str, float]] = field(default_factory=dict)
    """Class -> {"waiting": requests waiting now, "wait_p90": seconds (when any left the queue)}."""
    served: dict[str, dict[str, int]] = field(default_factory=dict)
    """Team -> {"tokens": served through the fair queue over the window, "weight": its weight there}."""

    @classmethod
    def of(cls, profile: Profile, window: ModelWindow | None) -> Felt:
        if window is None:
            return cls()
        ttft = _p90(window.ttft, FIRST_TOKEN_BUCKETS)
        itl = _p90(window.itl, INTER_TOKEN_BUCKETS)
        ratios = []
        ttft_attained = itl_attained = None
        if (objective := profile.ttft_objective_seconds) is not None and ttft is not None:
            ratios.append(ttft / objective)
            ttft_attained = share_within(window.ttft, FIRST_TOKEN_BUCKETS, objective)
        if (objective := profile.itl_objective_seconds) is not None and itl is not None:
            ratios.append(itl / objective)
            itl_attained = share_within(window.itl, INTER_TOKEN_BUCKETS, objective)
        return cls(
            ttft_p90=ttft,
            itl_p90=itl,
            ttft_attained=ttft_attained,
            itl_attained=itl_attained,
            ratio=max(ratios) if ratios else None,
            streams=sum(window.ttft),
            queue=_queue(window),
            served={team: {"tokens": n, "weight": window.weights.get(team, 1)} for team, n in window.served.items()},
        )


def _p90(counts: list[int], bounds: tuple[float, ...]) -> float | None:
    return quantile(counts, bounds, P90) if sum(counts) >= MIN_OBSERVATIONS else None


def _queue(window: ModelWindow) -> dict[str, dict[str, float]]:
    queue: dict[str, dict[str, float]] = {}
    for name, count in window.waiting.items():
        queue.setdefault(name, {})["waiting"] = count
    for name, counts in window.waits.items():
        wait = quantile(counts, QUEUE_WAIT_BUCKETS, P90)
        if wait is not None:
            queue.setdefault(name, {"waiting": 0})["wait_p90"] = round(wait, 3)
    for figures in queue.values():
        figures.setdefault("waiting", 0)
    return queue


@dataclass(frozen=True)
class Step:
    """What the objectives say this tick: whether the model is over them, its pressure, and the replicas to add
    once it has been over long enough."""

    over: bool
    pressure: float | None
    add: int


def step(
    ratio: float | None,
    seen: float,
    ready: int,
    starting: int,
    was_over: bool,
    up: float,
    down: float,
    growth: float = 1.0,
) -> Step:
    """The objectives' rule (the module docstring) for a model with `ready` replicas serving and `starting` ones
    on their way, over its objectives until now if `was_over`. `seen` is how many replicas the window saw serving:
    each ready one counts for the share of the window it was ready (`seen_in_window`). `growth` is how much the
    load will have grown by the time a replica started now serves (`look_ahead`)."""
    if ratio is None or not ready or not seen:
        return Step(False, None, 0)
    ratio *= growth
    pressure = ratio * seen / (ready + starting)
    over = pressure >= up or (was_over and pressure > down)
    if pressure < up:
        return Step(over, pressure, 0)
    missing = math.ceil(seen * ratio / up) - (ready + starting)
    return Step(over, pressure, min(max(missing, 1), ready))


def seen_in_window(ready_since: list[datetime | None], now: datetime, window_seconds: float) -> float:
    """How many replicas the routers' window saw serving: each ready replica for the share of the window it has been
    ready (one ready before the window began, or since an unknown time, counts whole)."""
    seen = 0.0
    for since in ready_since:
        age = window_seconds if since is None else (now - since).total_seconds()
        seen += min(1.0, max(0.0, age) / window_seconds)
    return seen


MAX_GROWTH = 4.0
"""The most the look-ahead multiplies the load by: a trend read over one window is not a forecast of hours."""


def look_ahead(
    trend: list[list[float]], streams: int, now: float, start_seconds: float | None, window_seconds: float
) -> tuple[float, list[list[float]]]:
    """How much the load will have grown by the time a replica started now serves — the streams that began in the
    window, their rise per second over the last window (from `trend`, samples [Unix time, streams] a quarter of
    a window apart), projected over the profile's learned start time: (1 + rise × start / streams), at least 1
    (a falling load is left to the idle timeout and the spares), at most MAX_GROWTH — and the trend kept for the
    next tick. 1 until the trend spans half a window, without a learned start time or with too few streams."""
    kept = [sample for sample in trend if now - sample[0] <= window_seconds * 1.25]
    if not kept or now - kept[-1][0] >= window_seconds / 4:
        kept.append([now, float(streams)])
    oldest_at, oldest = kept[0]
    span = now - oldest_at
    if start_seconds is None or streams < MIN_OBSERVATIONS or span < window_seconds / 2:
        return 1.0, kept
    rise = (streams - oldest) / span
    return min(MAX_GROWTH, max(1.0, 1.0 + rise * start_seconds / streams)), kept
