"""What users felt of a model over a router's recent window: the figures objective scaling and the operators' view
read (reconciler.demand.objectives).

Each router counts, per model, over its last LLMGW_LATENCY_WINDOW_SECONDS: its
streams' times to first token and gaps between tokens (as counts per bucket of
the bounds below, the same as its Prometheus histograms), its fair queue's
waits per class (counts per bucket) and the requests waiting in it now, and
the tokens it served each team from the queue. It sends them with every usage
report (`UsageReport.windows`, kept in its watch mark), so the control plane
sums the live routers' windows bucket by bucket: a fleet's p90 is read from
the summed counts, never averaged from each router's.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Annotated

import msgspec

from hub.records import NonNegative

# A first token may wait for a cold start (20-600 s), a next one tens of milliseconds. A p90 is read within a
# bucket by linear interpolation, so the bounds are close where objectives are set (a first token in 0.1-2 s, a
# gap in 20-250 ms): one bucket as wide as 0.15-0.25 s would read a p90 of 175 ms gaps as up to 240 ms.
FIRST_TOKEN_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 7.5,
    10, 20, 30, 60, 120, 300, 600,
)  # fmt: skip
INTER_TOKEN_BUCKETS = (
    0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.11, 0.125, 0.14, 0.16,
    0.18, 0.2, 0.225, 0.25, 0.3, 0.4, 0.5, 1, 2.5,
)  # fmt: skip
QUEUE_WAIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)


class ModelWindow(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """One model's figures over one router's window (empty lists and maps: nothing seen).

    Counts per bucket have one more entry than their bounds (the last is
    +Inf); a value equal to a bound counts in that bound's bucket.
    """

    ttft: list[NonNegative] = []
    """Streams' times to first token (hold and queue wait included), per FIRST_TOKEN_BUCKETS bucket."""
    itl: list[NonNegative] = []
    """Gaps between a stream's chunks, per INTER_TOKEN_BUCKETS bucket."""
    waits: dict[str, list[NonNegative]] = {}
    """Priority class -> waits of requests that left the fair queue, per QUEUE_WAIT_BUCKETS bucket."""
    waiting: dict[str, NonNegative] = {}
    """Priority class -> requests waiting in the fair queue at the report."""
    served: dict[str, NonNegative] = {}
    """Team (keys of no team together as "(no team)") -> tokens of its answers that went through the fair queue."""
    weights: dict[str, Annotated[int, msgspec.Meta(ge=1)]] = {}
    """Team -> its weight in the fair queue, as the router last saw it (teams in `served`)."""

    def __post_init__(self) -> None:
        _check_counts("ttft", self.ttft, FIRST_TOKEN_BUCKETS)
        _check_counts("itl", self.itl, INTER_TOKEN_BUCKETS)
        for name, counts in self.waits.items():
            _check_counts(f"waits[{name}]", counts, QUEUE_WAIT_BUCKETS)


def _check_counts(field: str, counts: Sequence[int], bounds: Sequence[float]) -> None:
    if counts and len(counts) != len(bounds) + 1:
        raise ValueError(f"{field} has {len(counts)} bucket counts, not {len(bounds) + 1}")


def add_counts(total: list[int], counts: Sequence[int]) -> list[int]:
    """`total` with `counts` added bucket by bucket (an empty `total` takes `counts`)."""
    if not total:
        return list(counts)
    if counts:
        for i, count in enumerate(counts):
            total[i] += count
    return total


def quantile(counts: Sequence[int], bounds: Sequence[float], q: float) -> float | None:
    """The `q` quantile (0 < q < 1) of values counted per bucket, interpolated linearly within its bucket the way
    Prometheus' histogram_quantile does; None when nothing was counted. In the +Inf bucket: the last bound."""
    total = sum(counts)
    if not total:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(counts):
        if count and seen + count >= rank:
            if i == len(bounds):
                return float(bounds[-1])
            low = float(bounds[i - 1]) if i else 0.0
            return low + (float(bounds[i]) - low) * (rank - seen) / count
        seen += count
    return float(bounds[-1])


def share_within(counts: Sequence[int], bounds: Sequence[float], limit: float) -> float | None:
    """The share of values counted per bucket that are at most `limit` (interpolated linearly within the bucket
    `limit` falls in; those above the last bound count as beyond it); None when nothing was counted."""
    total = sum(counts)
    if not total:
        return None
    i = bisect_left(bounds, limit)
    below: float = sum(counts[:i])
    if i < len(bounds) and counts[i]:
        low = float(bounds[i - 1]) if i else 0.0
        below += counts[i] * (limit - low) / (float(bounds[i]) - low)
    return below / total


def merged(windows: Iterable[ModelWindow]) -> ModelWindow:
    """The windows of several routers for one model, summed (bucket counts, waiting requests, tokens served)."""
    ttft: list[int] = []
    itl: list[int] = []
    waits: dict[str, list[int]] = {}
    waiting: dict[str, int] = {}
    served: dict[str, int] = {}
    weights: dict[str, int] = {}
    for window in windows:
        ttft = add_counts(ttft, window.ttft)
        itl = add_counts(itl, window.itl)
        for name, counts in window.waits.items():
            waits[name] = add_counts(waits.get(name, []), counts)
        for name, count in window.waiting.items():
            waiting[name] = waiting.get(name, 0) + count
        for team, tokens in window.served.items():
            served[team] = served.get(team, 0) + tokens
        weights.update(window.weights)
    return ModelWindow(ttft=ttft, itl=itl, waits=waits, waiting=waiting, served=served, weights=weights)
