"""Each model's recent window (hub.windows), cut from the router's cumulative figures at every usage flush.

The router already counts, for Prometheus, its streams' first-token times and
inter-token gaps (router.metrics.Traffic) and its fair queues' waits and
served tokens (router.forwarding.admission). Here, once per flush and off the
request path, those cumulative counts are copied; a window is the newest copy
less the newest one at least `window_seconds` old (or nothing, while the
router is younger than that: it counts from its start). A request pays nothing for it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hub.windows import ModelWindow

if TYPE_CHECKING:
    from router.forwarding.admission import Admission
    from router.metrics import Traffic

_Copy = dict[tuple[Any, ...], Any]
"""(figure, model, …) -> cumulative counts (a tuple per bucket) or a cumulative total."""


class RecentWindows:
    """Copies of the cumulative figures at each flush, and the window per model between the newest and the base."""

    def __init__(
        self,
        traffic: Traffic,
        admission: Admission,
        window_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not window_seconds > 0:
            raise ValueError(f"window_seconds must be > 0, not {window_seconds!r}")
        self.traffic, self.admission = traffic, admission
        self.window_seconds = window_seconds
        self._clock = clock
        # Nothing was counted when the router started: that is the base until a copy is a window old.
        self._copies: deque[tuple[float, _Copy]] = deque([(clock(), {})])

    def take(self) -> dict[str, ModelWindow]:
        """Copy the figures now and return each model's window (models with nothing in it are left out)."""
        now = self._clock()
        newest = self._copy()
        copies = self._copies
        copies.append((now, newest))
        # Keep the newest copy at least a window old as the base; drop what is older than it.
        while len(copies) > 2 and copies[1][0] <= now - self.window_seconds:
            copies.popleft()
        return _windows(newest, copies[0][1], self.admission.waiting(), self.admission.weights)

    def _copy(self) -> _Copy:
        traffic, admission = self.traffic, self.admission
        copy: _Copy = {}
        for model, counts in traffic.first_token.counts().items():
            copy["ttft", model] = counts
        for model, counts in traffic.inter_token.counts().items():
            copy["itl", model] = counts
        for (model, name), counts in admission.waits.counts().items():
            copy["waits", model, name] = counts
        for (model, team), tokens in admission.served_tokens.items():
            copy["served", model, team] = tokens
        return copy


def _windows(
    newest: _Copy, base: _Copy, waiting: dict[tuple[str, str], int], weights: dict[str, int]
) -> dict[str, ModelWindow]:
    """Per model: `newest` less `base`, its requests waiting now, and the weights of the teams it served."""
    parts: dict[str, dict[str, Any]] = {}
    for key, value in newest.items():
        figure, model, *rest = key
        before = base.get(key)
        if isinstance(value, tuple):
            delta: Any = list(value) if before is None else [a - b for a, b in zip(value, before, strict=True)]
            if not any(delta):
                continue
        else:
            delta = value - (before or 0)
            if not delta:
                continue
        part = parts.setdefault(model, {})
        if rest:
            part.setdefault(figure, {})[rest[0]] = delta
        else:
            part[figure] = delta
    for (model, name), count in waiting.items():
        if count:
            parts.setdefault(model, {}).setdefault("waiting", {})[name] = count
    for part in parts.values():
        if served := part.get("served"):
            part["weights"] = {team: weights[team] for team in served if team in weights}
    return {model: ModelWindow(**part) for model, part in parts.items()}
