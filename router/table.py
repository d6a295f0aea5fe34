"""The endpoint table as the router reads it: each ready replica an `Endpoint`, each model's names and notes.

The control plane publishes plain JSON (hub.contracts.EndpointTable); these
functions turn it into the balancer's structures, skipping what is malformed
rather than failing the whole table.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

from .ejection import ReplicaHealth


@dataclass(eq=False)
class Endpoint:
    """One ready replica of a model, as published by the control plane.

    `outstanding` counts requests this router has sent to it that have not
    finished, and `health` its failures and ejection; both survive table
    updates as long as the replica keeps its URL.
    """

    replica_id: str
    model: str
    url: str
    priority: int = 0
    weight: int = 1
    pool: str = "default"
    outstanding: int = field(default=0, compare=False)
    health: ReplicaHealth = field(default_factory=ReplicaHealth, compare=False, repr=False)
    # The engine's own load, last polled (router.engine_load): None while unknown.
    engine_waiting: float | None = field(default=None, compare=False)
    kv_usage: float | None = field(default=None, compare=False)
    # What the pick reads: unknown load counts as no extra load and never as full.
    queued: float = field(default=0.0, compare=False, repr=False)
    kv_full: bool = field(default=False, compare=False, repr=False)
    # Stable across routers and restarts (unlike hash() of a str), so every router prefers the same replica per key.
    affinity_seed: int = field(init=False, compare=False, repr=False)
    replica_id_bytes: bytes = field(init=False, compare=False, repr=False)  # as every answer's header names it

    def __post_init__(self) -> None:
        self.replica_id_bytes = self.replica_id.encode()
        self.affinity_seed = zlib.crc32(self.replica_id_bytes)

    @property
    def load(self) -> float:
        return (self.outstanding + self.queued) / self.weight


class TableError(ValueError):
    """An endpoint table that does not have the published shape."""


def parse_endpoint(raw: object) -> Endpoint:
    """One published endpoint row as an Endpoint; TableError says what is wrong with it."""
    if not isinstance(raw, dict):
        raise TableError(f"endpoint entry is not an object: {raw!r}")
    try:
        replica_id, model, url = str(raw["replica_id"]), raw["model"], raw["url"]
    except KeyError as exc:
        raise TableError(f"endpoint entry lacks {exc.args[0]!r}: {raw!r}") from None
    if not isinstance(model, str) or not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise TableError(f"endpoint entry has a bad model or url: {raw!r}")
    priority, weight = raw.get("priority", 0), raw.get("weight", 1)
    if not isinstance(priority, int) or not isinstance(weight, int) or weight < 1:
        raise TableError(f"endpoint entry has a bad priority or weight: {raw!r}")
    return Endpoint(replica_id, model, url.rstrip("/"), priority, weight, str(raw.get("pool", "default")))


def parse_models(
    models: dict[str, Any],
) -> tuple[dict[str, str], dict[str, list[str]], dict[str, str], dict[str, str], dict[str, float]]:
    """(name or alias -> public name, public name -> aliases, unplaceable reasons, failed-start reasons,
    learned start seconds) from the table's `models`."""
    names: dict[str, str] = {}
    catalog: dict[str, list[str]] = {}
    unplaceable: dict[str, str] = {}
    start_failed: dict[str, str] = {}
    start_seconds: dict[str, float] = {}
    for public, entry in models.items():
        aliases = entry.get("aliases", []) if isinstance(entry, dict) else []
        aliases = [a for a in aliases if isinstance(a, str)]
        catalog[public] = aliases
        reason = entry.get("unplaceable") if isinstance(entry, dict) else None
        if isinstance(reason, str) and reason:
            unplaceable[public] = reason
        failure = entry.get("failed") if isinstance(entry, dict) else None
        if isinstance(failure, str) and failure:
            start_failed[public] = failure
        start = entry.get("start_seconds") if isinstance(entry, dict) else None
        if isinstance(start, int | float) and not isinstance(start, bool) and start >= 0:
            start_seconds[public] = float(start)
        names[public] = public
        for alias in aliases:
            names.setdefault(alias, public)  # a public name always wins over a clashing alias
    return names, catalog, unplaceable, start_failed, start_seconds
