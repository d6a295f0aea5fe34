"""Replicas read as plain rows where a tick reads the whole fleet's and decides on a few columns."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


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
