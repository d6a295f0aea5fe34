"""Replicas read as plain rows where a tick reads the whole fleet's and decides on a few columns."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar

from reconciler.choices import ReplicaState


@dataclass(slots=True)
class ReplicaRow:
    """A replica as demand reads it: the columns it decides on, not a model instance. A steady tick reads every
    replica of the fleet, and building Django instances for them cost more than the query (bench/tick_bench.py)."""

    pk: int
    model_id: int
    profile_id: int
    state: str
    last_used: datetime | None
    demand_until: datetime | None
    drain_deadline: datetime | None
    sleep_level: int | None
    wanted_since: datetime | None
    pools: list[str]
    failure_count: int = 0
    busy: bool = False
    """A shard of it reports running requests (the engine's own count)."""
    ready_at: datetime | None = None
    parked_since: datetime | None = None

    COLUMNS: ClassVar[tuple[str, ...]] = (
        "id", "model_id", "profile_id", "state", "last_used", "demand_until", "drain_deadline", "sleep_level",
        "wanted_since", "pools", "failure_count", "busy", "ready_at", "parked_since",
    )  # fmt: skip
    """What to read for it, in its fields' order (`busy` an annotation of the query)."""


@dataclass(frozen=True)
class FleetCensus:
    """What kinds of replica the fleet held when demand read it, before demand's own changes: the tick skips a
    step with no replica of its kind (each is a query), counting what its earlier steps made (`reconciler.tick`)."""

    states: frozenset[str] = frozenset()
    forgivable: bool = False
    """Some READY replica still counts failures (`lifecycle.forgive_stable`)."""
    draining: bool = False
    """Some replica not stopping waits for its replacement (`drain.drain_replaced`)."""

    @classmethod
    def of(cls, rows: list[ReplicaRow]) -> FleetCensus:
        return cls(
            states=frozenset(row.state for row in rows),
            forgivable=any(row.failure_count and row.state == ReplicaState.READY for row in rows),
            draining=any(row.drain_deadline is not None and row.state != ReplicaState.STOPPING for row in rows),
        )
