"""What crosses between the control plane and the routers, as typed interfaces.

The control plane (the reconcile tick) and the routers never import each
other: both depend on these protocols, and each mode supplies one object that
implements all of them (`hub.memory.InProcessHub` embedded,
`hub.redis_hub.RedisHub` distributed).

* endpoint table: the tick publishes, routers read and watch (DESIGN invariant 7);
* usage reports: each router flushes its last-use stamps (invariant 4), its
  per-model peak of requests in flight, its requests and tokens per API key and
  model with each key's last use, and renews its own watch mark ("I am
  recording usage"), so the tick can tell "never used while watched" from
  "unknown", and notice one router that cannot flush (invariant 3). Token
  counts add up in the hub until the tick takes them (read and reset at once);
* activation queue: routers ask for a model to be started, the tick drains;
* key changes: the control plane names API keys (by hash) that were revoked,
  deleted or edited, and every router drops them from its cache at once;
* rate-limit counters: routers add up what limited keys used this minute.

Control-plane methods are synchronous (they run inside the tick); router
methods are coroutines (they run on the router's loop).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

EndpointTable = dict[str, Any]
"""{"models": {name: {"aliases": [...], "unplaceable"?: str, "failed"?: str, "start_seconds"?: float}},
"endpoints": [{"replica_id", "model", "url", "priority", "weight", "pool"}], "fingerprint": str}"""

TokenCounts = dict[str, dict[str, list[int]]]
"""API-key digest (`hub.credentials.hash_secret`) -> public model name -> [requests, prompt tokens, completion tokens]."""

HOUR = 3600


def hour_of(ts: float) -> int:
    """The start (Unix seconds, UTC) of the hour `ts` falls in: token counts are kept per hour."""
    return int(ts // HOUR) * HOUR


class EndpointSink(Protocol):
    """The control plane's side of the endpoint table."""

    def publish_endpoints(self, table: EndpointTable) -> bool:
        """Publish `table` if its fingerprint changed; return whether it was published."""
        ...


class EndpointSource(Protocol):
    """The router's side of the endpoint table."""

    async def read_endpoints(self) -> EndpointTable | None: ...

    def watch_endpoints(self) -> AsyncIterator[EndpointTable]:
        """Yield each newly published table, forever."""
        ...


@dataclass(frozen=True)
class UsageReport:
    """One router's flush: what it saw since its previous flush, and its watch mark renewed for `ttl` seconds."""

    router: str
    """This router's id, unique per process (it starts a new watch when the process starts)."""
    stamps: dict[str, float] = field(default_factory=dict)
    """Replica id -> last use (Unix time); newest wins across routers."""
    in_flight: dict[str, int] = field(default_factory=dict)
    """Public model name -> the most requests this router had in flight at once since its previous flush."""
    ttl: float = 3.0
    tokens: TokenCounts = field(default_factory=dict)
    """Requests and tokens per key digest and model since the previous flush; counters: they add up."""
    keys: dict[str, float] = field(default_factory=dict)
    """Key digest -> last use (Unix time); newest wins across routers."""

    def __post_init__(self) -> None:
        # A report crosses a process boundary: refuse a malformed one where it is built.
        if not isinstance(self.router, str) or not self.router:
            raise ValueError(f"usage report: router id must be a non-empty string, got {self.router!r}")
        if not isinstance(self.ttl, int | float) or not math.isfinite(self.ttl) or self.ttl <= 0:
            raise ValueError(f"usage report from {self.router}: ttl must be a finite number > 0, got {self.ttl!r}")
        for model, count in self.in_flight.items():
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ValueError(
                    f"usage report from {self.router}: in-flight count for {model!r} must be an int >= 0, got {count!r}"
                )
        check_token_counts(self.tokens, f"usage report from {self.router}")
        for digest, ts in self.keys.items():
            if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts):
                raise ValueError(
                    f"usage report from {self.router}: last use of key {digest!r} must be a time, got {ts!r}"
                )


def check_token_counts(tokens: TokenCounts, where: str) -> None:
    """Raise ValueError unless `tokens` is {digest: {model: [requests, prompt, completion]}} of ints >= 0."""
    for digest, models in tokens.items():
        if not isinstance(digest, str) or not digest or not isinstance(models, dict):
            raise ValueError(f"{where}: token counts must map key digests to models, got {digest!r}: {models!r}")
        for model, row in models.items():
            if (
                not isinstance(model, str)
                or not isinstance(row, list)
                or len(row) != 3
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in row)
            ):
                raise ValueError(
                    f"{where}: token counts of {model!r} must be [requests, prompt, completion] ints >= 0, got {row!r}"
                )


@dataclass(frozen=True)
class RouterMark:
    """One router's watch mark, as the tick reads it (times are Unix seconds)."""

    router: str
    since: float
    """When this router's unbroken run of flushes began."""
    renewed: float
    """When it last flushed; past `renewed + ttl` the mark has lapsed."""
    ttl: float
    in_flight: dict[str, int] = field(default_factory=dict)
    """Its last report's per-model peak in flight."""

    def lapsed(self, now: float) -> bool:
        return now - self.renewed > self.ttl


@dataclass(frozen=True)
class UsageSnapshot:
    """What the tick collects: every router's mark, read before the stamps.

    Marks first: a router flushes its stamps before renewing its mark, so a mark
    seen renewed guarantees the stamps it vouches for are in `stamps`.
    """

    stamps: dict[str, float]
    routers: list[RouterMark]
    tokens: dict[int, TokenCounts] = field(default_factory=dict)
    """Start of the hour (Unix seconds) the routers reported in -> token counts: TAKEN from the hub, which
    starts counting again from zero, so each count reaches exactly one snapshot."""
    keys: dict[str, float] = field(default_factory=dict)
    """Key digest -> last use (Unix time), taken from the hub like `tokens`."""


class UsageSink(Protocol):
    """Where routers report usage (stamps, in-flight peaks) and renew their own watch mark."""

    async def report_usage(self, report: UsageReport) -> None:
        """Record the stamps and keys' last use (newest wins), add the token counts to the hour's, then renew the
        router's mark, all in one step; raise if the store cannot take them."""
        ...

    async def leave(self, router: str) -> None:
        """A router shutting down cleanly withdraws its mark (its stamps are already flushed)."""
        ...


class UsageSource(Protocol):
    """Where the tick reads usage and router marks."""

    def collect_usage(self) -> UsageSnapshot:
        """Read marks and stamps, and TAKE the token counts and keys' last use (read and reset in one step).

        Only the leader's tick calls it: what it takes is stored by that tick
        (reconciler.tokens) or given back with `restore_tokens`.
        """
        ...

    def restore_tokens(self, tokens: dict[int, TokenCounts], keys: dict[str, float]) -> None:
        """Give back token counts (they add up again) and last uses (newest wins) a tick took but could not store."""
        ...

    def forget_usage(self, replica_ids: Iterable[str | int]) -> None: ...

    def forget_routers(self, routers: Iterable[str]) -> None:
        """Drop the marks of routers presumed gone (lapsed past LLMGW_ROUTER_FORGET_SECONDS)."""
        ...


class ActivationQueue(Protocol):
    """Routers ask for models to be started; the tick takes every request once."""

    async def request_activation(self, model_name: str) -> None: ...

    def drain_activations(self) -> set[str]: ...


class KeyChangeSink(Protocol):
    """The control plane's side of key changes."""

    def publish_key_changes(self, digests: list[str]) -> None:
        """Tell every router these keys (sha256 hashes) changed; raise if the store cannot take it."""
        ...


class KeyChangeSource(Protocol):
    """The router's side of key changes."""

    def watch_key_changes(self) -> AsyncIterator[list[str]]:
        """Yield the hashes of each batch of changed keys published from now on, forever."""
        ...


class RateLimitCounters(Protocol):
    """Per-minute request and token counts of rate-limited keys, added up over every router."""

    async def sync_limits(self, minute: int, deltas: dict[str, list[int]]) -> tuple[dict[str, list[int]], int]:
        """Add this router's {key digest: [requests, tokens]} to `minute`'s counts; return those keys' totals
        over every router and how many routers report usage (for each one's share)."""
        ...


class UsageExchange(UsageSink, RateLimitCounters, Protocol):
    """What a router's usage flusher talks to: usage reports, then rate-limit counts."""


class ControlPlaneHub(EndpointSink, UsageSource, ActivationQueue, KeyChangeSink, Protocol):
    """Everything the reconcile tick needs from the hub."""


class RouterHub(EndpointSource, UsageSink, ActivationQueue, KeyChangeSource, RateLimitCounters, Protocol):
    """Everything a router needs from the hub."""
