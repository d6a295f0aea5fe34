"""What crosses between the control plane and the routers, as typed interfaces.

The control plane (the reconcile tick) and the routers never import each
other: both depend on these protocols, and each mode supplies one object that
implements all of them (`hub.memory.InProcessHub` embedded,
`hub.redis_hub.RedisHub` distributed).

* endpoint table (`EndpointTable`): the tick publishes, routers read, watch and decode it (DESIGN invariant 7);
* usage reports: each router flushes its last-use stamps (invariant 4), its
  per-model peak of requests in flight, its requests and tokens per API key and
  model with each key's last use, and renews its own watch mark ("I am
  recording usage"), so the tick can tell "never used while watched" from
  "unknown", and notice one router that cannot flush (invariant 3). Token
  counts (`TokenCount`) add up in the hub until the tick takes them (read and reset at once), and so do the
  counts of streams whose engine broke off (`ContinuationCount`, per model);
* activation queue: routers ask for a model to be started (`Activation`: in the asking key's pools, if it is
  bound to some), the tick drains;
* key changes: the control plane names API keys (by hash) that were revoked,
  deleted or edited, and every router drops them from its cache at once;
* rate-limit counters: routers add up what limited keys used this minute;
* budgets: routers reserve a request's worst case at admission and settle its cost at its end (hub.budgets).

Control-plane methods are synchronous (they run inside the tick); router
methods are coroutines (they run on the router's loop).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Annotated, Literal, NamedTuple, Protocol

import msgspec

# Re-exported: the hub's contracts are read from here.
from hub.budgets import BudgetCounters as BudgetCounters
from hub.budgets import BudgetReader as BudgetReader
from hub.counts import HOUR as HOUR
from hub.counts import ContinuationCount as ContinuationCount
from hub.counts import ContinuationCounts as ContinuationCounts
from hub.counts import ReplicaTokens as ReplicaTokens
from hub.counts import TokenCount as TokenCount
from hub.counts import TokenCounts as TokenCounts
from hub.counts import add_continuation_counts as add_continuation_counts
from hub.counts import add_replica_tokens as add_replica_tokens
from hub.counts import add_token_counts as add_token_counts
from hub.counts import hour_of as hour_of
from hub.records import Name as Name
from hub.records import NonNegative as NonNegative
from hub.records import RequestRecord as RequestRecord
from hub.records import UnixTime as UnixTime
from hub.windows import ModelWindow as ModelWindow

log = logging.getLogger(__name__)

# An engine's bearer key: visible ASCII only, so it can travel in an Authorization header as it is.
UpstreamKey = Annotated[str, msgspec.Meta(pattern=r"^[!-~]+$")]


Holding = Literal["wake", "making_room", "staging"]
"""Why routers hold a model's requests, when the control plane knows better than "a cold start"."""


class ModelEntry(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """One enabled model as routers know it: its aliases, and why requests for it cannot wait, if they cannot."""

    aliases: list[str] = []
    unplaceable: Name | None = None
    """Why the control plane cannot place it now: routers answer at once instead of holding requests."""
    failed: Name | None = None
    """Why its only wanted replica failed (the engine's own last words)."""
    start_seconds: Annotated[float, msgspec.Meta(ge=0)] | None = None
    """How long its first profile takes from placement to ready, as learned; None while unknown."""
    holding: Holding | None = None
    """Why its requests are held, when it is not a start: its wanted replicas only sleep (`wake`), or room is
    being made for its pending replica (`making_room`), or its weights are being fetched to its nodes
    (`staging`: then `start_seconds` includes what is left to fetch). None (and left out of the wire): a cold
    start, or nothing held."""
    unplaceable_pools: list[str] = []
    """The pools the replica `unplaceable` speaks of was started for: it answers only keys bound to all of them
    (a key bound to other pools, or to none, has a start of its own). Empty: it answers every key."""
    pools: list[str] = []
    """The pools of its profiles, sorted: a key bound to none of them is refused at once. Empty: not known
    (a table from before pools were published, or a static one), so no key is refused for its pools."""
    continue_streams: bool = True
    """Whether routers continue its streams on another replica when their engine breaks off (the catalog's
    switch; router.forwarding.continuation)."""
    token_ids: bool = False
    """Whether every engine of its profiles accepts vLLM's `return_token_ids` and token-id prompts, so a broken
    stream is continued token for token rather than from its text."""
    price_input: NonNegative = 0
    price_output: NonNegative = 0
    """What one prompt (input) and one completion (output) token cost, in spend units (hub.budgets.SPEND_UNITS:
    the catalog's price per million with six decimals, times 10^6); 0 = free."""
    output_bound: NonNegative = 0
    """The most tokens one of its answers may have when the request sets no limit: its profiles' largest
    `max_model_len`; 0 = not known. Routers reserve a budget's worst case with it."""
    priority_scheduling: bool = False
    """Whether every engine of its profiles orders its own waiting requests by priority (vLLM's
    `--scheduling-policy priority`): routers then set each request's `priority` to its class's rank."""


class EndpointRow(msgspec.Struct, kw_only=True, frozen=True):
    """One READY replica routers may send a model's requests to.

    `api_key`: the bearer key its engine was started with (`--api-key`), sent to it and to no other; only
    router-only mode sets it. Unset, it is left out of the wire, so the fleet's tables are the same bytes as
    before it existed; its repr never shows it. `capacity`: the requests it runs at once (its profile's
    `max_concurrency`), past which routers hold its model's requests in their fair queue; unset: no bound.
    """

    replica_id: Name
    model: Name
    url: Annotated[str, msgspec.Meta(pattern=r"^https?://")]
    priority: int = 0
    weight: Annotated[int, msgspec.Meta(ge=1)] = 1
    pool: str = "default"
    api_key: UpstreamKey | msgspec.UnsetType = msgspec.UNSET
    capacity: Annotated[int, msgspec.Meta(ge=1)] | msgspec.UnsetType = msgspec.UNSET

    def __repr__(self) -> str:
        key = "" if self.api_key is msgspec.UNSET else ", api_key=<set>"
        capacity = "" if self.capacity is msgspec.UNSET else f", capacity={self.capacity}"
        return (
            f"EndpointRow({self.replica_id!r}, {self.model!r}, {self.url!r}, priority={self.priority}, "
            f"weight={self.weight}, pool={self.pool!r}{capacity}{key})"
        )


class AdapterEntry(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """One enabled LoRA adapter as routers know it: the model it rides on, its aliases, the replicas holding it.

    A request naming it goes to one of `replicas` (ready replicas of `base`, in the table's endpoints, whose
    engine has it loaded) with `model` set to the adapter's public name, the name the engine loaded it under.
    None holding it: routers ask for it like an activation and hold the request until one does.
    """

    base: Name
    aliases: list[str] = []
    replicas: list[Name] = []
    loading: bool = False
    """The control plane has sent a load for it that has not been answered yet."""
    price_input: NonNegative = 0
    price_output: NonNegative = 0
    """Its token prices as ModelEntry's: its own, or its base model's where it sets none."""


ADAPTER_STAMP_SEPARATOR = "/"
"""Usage stamps of adapters are keyed `"<replica id>/<adapter public name>"` beside the replicas' own ids."""


class EndpointTable(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """What the tick publishes and routers serve from (DESIGN invariant 7): models by public name, endpoints,
    LoRA adapters by public name.

    `fingerprint` is empty as built; the hub sets it to `fingerprint(table)` when it publishes.
    """

    models: dict[str, ModelEntry] = {}
    endpoints: list[EndpointRow] = []
    adapters: dict[str, AdapterEntry] = {}
    moving: dict[Name, UnixTime] = {}
    """Replica id -> when (Unix time) routers move the streams they still relay from it to other replicas: replicas
    unpublished for a drain or a sleep, whose engines finish what they hold until then (router.forwarding.moves)."""
    fingerprint: str = ""


class EndpointSink(Protocol):
    """The control plane's side of the endpoint table."""

    def publish_endpoints(self, table: EndpointTable) -> bool:
        """Publish `table` if its fingerprint changed; return whether it was published."""
        ...


class EndpointSource(Protocol):
    """The router's side of the endpoint table: the published table as JSON, for the router to decode.

    Encoded, whichever hub: routers decode it row by row (router.endpoints.table), so one
    malformed row costs that row, never the table.
    """

    async def read_endpoints(self) -> bytes | None: ...

    def watch_endpoints(self) -> AsyncIterator[bytes]:
        """Yield each newly published table, forever."""
        ...


class UsageReport(msgspec.Struct, kw_only=True, frozen=True):
    """One router's flush: what it saw since its previous flush, and its watch mark renewed for `ttl` seconds.

    The hubs take it only through `checked`, which refuses a malformed one naming the field.
    """

    router: Name
    """This router's id, unique per process (it starts a new watch when the process starts)."""
    stamps: dict[str, float] = {}
    """Replica id -> last use (Unix time); newest wins across routers. A request for a LoRA adapter also stamps
    `"<replica id>/<adapter>"` (ADAPTER_STAMP_SEPARATOR), the adapter's last use on that replica."""
    in_flight: dict[str, NonNegative] = {}
    """Public model name -> the most requests this router had in flight at once since its previous flush."""
    ttl: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 3.0
    tokens: dict[Name, dict[str, TokenCount]] = {}
    """Requests and tokens per key digest and model since the previous flush; counters: they add up."""
    keys: dict[str, UnixTime] = {}
    """Key digest -> last use (Unix time); newest wins across routers."""
    continuations: dict[Name, ContinuationCount] = {}
    """Public model name -> its answers whose engine broke off since the previous flush; counters: they add up.
    Absent from the reports of routers older than it, which count none."""
    records: list[RequestRecord] = []
    """Each request since the previous flush, where routers keep a per-request log (LLMGW_REQUEST_RECORD_DAYS)."""
    replica_tokens: dict[Name, dict[str, NonNegative]] = {}
    """Replica id -> key digest -> tokens served since the previous flush (ReplicaTokens); counters: they add up.
    Absent from the reports of routers older than it."""
    windows: dict[Name, ModelWindow] = {}
    """Public model name -> what its users felt over this router's recent window (hub.windows); replaced by each
    report, like `in_flight`. Absent from the reports of routers older than it."""


def checked(report: UsageReport) -> UsageReport:
    """`report` validated against its declared types; msgspec.ValidationError (a ValueError) names what is wrong.

    A report is built in the router's process and stored by the hub: this is where
    the hub refuses one a bug made malformed, before any of it is stored.
    """
    return msgspec.convert(msgspec.to_builtins(report), UsageReport)


@dataclass(frozen=True, kw_only=True)
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
    windows: dict[str, ModelWindow] = field(default_factory=dict)
    """Its last report's per-model window (hub.windows)."""

    def lapsed(self, now: float) -> bool:
        return now - self.renewed > self.ttl


@dataclass(frozen=True, kw_only=True)
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
    continuations: dict[int, ContinuationCounts] = field(default_factory=dict)
    """Start of the hour -> broken answers per model, taken from the hub like `tokens`."""
    replica_tokens: dict[int, ReplicaTokens] = field(default_factory=dict)
    """Start of the hour -> tokens per replica and key, taken from the hub with `tokens` (in the same step)."""


class UsageSink(Protocol):
    """Where routers report usage (stamps, in-flight peaks) and renew their own watch mark."""

    async def report_usage(self, report: UsageReport) -> None:
        """Record the stamps and keys' last use (newest wins), add the token and continuation counts to the
        hour's, then renew the router's mark, all in one step; raise if the store cannot take them."""
        ...

    async def leave(self, router: str) -> None:
        """A router shutting down cleanly withdraws its mark (its stamps are already flushed)."""
        ...


class UsageSource(Protocol):
    """Where the tick reads usage and router marks."""

    def collect_usage(self) -> UsageSnapshot:
        """Read marks and stamps, and TAKE the token counts, keys' last use and continuation counts (read and
        reset in one step).

        Only the leader's tick calls it: what it takes is stored by that tick
        (reconciler.demand.tokens) or given back with `restore_tokens` and `restore_continuations`.
        """
        ...

    def restore_tokens(
        self, tokens: dict[int, TokenCounts], keys: dict[str, float], replicas: dict[int, ReplicaTokens] | None = None
    ) -> None:
        """Give back token counts (they add up again), last uses (newest wins) and tokens per replica a tick took
        but could not store."""
        ...

    def restore_continuations(self, continuations: dict[int, ContinuationCounts]) -> None:
        """Give back continuation counts ({hour: counts}) a tick took but could not store: they add up again."""
        ...

    def take_records(self) -> list[RequestRecord]:
        """TAKE the routers' per-request records (read and removed in one step), oldest first."""
        ...

    def restore_records(self, records: list[RequestRecord]) -> None:
        """Give back records a tick took but could not store."""
        ...

    def forget_usage(self, replica_ids: Iterable[str | int]) -> None: ...

    def forget_routers(self, routers: Iterable[str]) -> None:
        """Drop the marks of routers presumed gone (lapsed past LLMGW_ROUTER_FORGET_SECONDS)."""
        ...


class Activation(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A router's ask for a model to be started: its public name, and the pools a replica must be in to serve
    the key that asked (sorted; empty: any pool, any profile)."""

    model: Name
    pools: tuple[Name, ...] = ()

    @classmethod
    def of(cls, model: str, pools: Iterable[str] = ()) -> Activation:
        """The activation of `model` for a key bound to `pools` (in any order, repeats allowed)."""
        return cls(model=model, pools=tuple(sorted(set(pools))))


_decode_activation = msgspec.json.Decoder(Activation).decode


def encode_activation(activation: Activation) -> bytes:
    """An activation as a hub stores it: the bare model name when it names no pools (what every control plane
    understands, and all activations were before pools), else its JSON object. Public names never start with
    `{` (catalog.models.public_name_validator), so the two cannot be confused."""
    if not activation.pools:
        return activation.model.encode()
    return msgspec.json.encode(activation)


def decode_activation(raw: bytes | str) -> Activation | None:
    """An activation as `encode_activation` stored it; None (logged) for a malformed one, which is skipped."""
    data = raw.encode() if isinstance(raw, str) else raw
    try:
        if data.startswith(b"{"):
            return _decode_activation(data)
        return Activation(model=msgspec.convert(data.decode(), Name))
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        log.warning("skipping a malformed activation (%s): %r", exc, data[:200])
        return None


class TokenSource(Protocol):
    """Where router-only mode (no control plane, no tick) takes the token and continuation counts to store, and
    keeps the routers' marks (which the rate limits' shares count) free of routers that are gone."""

    def take_tokens(self) -> tuple[dict[int, TokenCounts], dict[str, float]]:
        """TAKE the token counts ({hour: counts}) and keys' last use, read and reset in one step: of several
        routers taking at once, each count reaches exactly one."""
        ...

    def restore_tokens(
        self, tokens: dict[int, TokenCounts], keys: dict[str, float], replicas: dict[int, ReplicaTokens] | None = None
    ) -> None: ...

    def take_continuations(self) -> dict[int, ContinuationCounts]:
        """TAKE the continuation counts ({hour: counts}), read and reset in one step, like `take_tokens`."""
        ...

    def restore_continuations(self, continuations: dict[int, ContinuationCounts]) -> None: ...

    def take_records(self) -> list[RequestRecord]: ...

    def restore_records(self, records: list[RequestRecord]) -> None: ...

    def router_marks(self) -> list[RouterMark]: ...

    def forget_routers(self, routers: Iterable[str]) -> None: ...


class ActivationQueue(Protocol):
    """Routers ask for models to be started; the tick takes every request once."""

    async def request_activation(self, model_name: str, pools: Iterable[str] = ()) -> None:
        """Ask for `model_name` to be started, on a profile in one of `pools` when the asking key is bound to
        some (empty: any profile)."""
        ...

    def drain_activations(self) -> set[Activation]: ...


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


class LimitCount(NamedTuple):
    """A rate-limited key's requests and tokens in one minute: what a router admitted since its last exchange,
    or the totals over every router."""

    requests: int
    tokens: int


LimitCounts = dict[str, LimitCount]
"""API-key digest -> its counts in one minute."""


class RateLimitCounters(Protocol):
    """Per-minute request and token counts of rate-limited keys, added up over every router."""

    async def sync_limits(self, minute: int, deltas: LimitCounts) -> tuple[LimitCounts, int]:
        """Add this router's counts per key digest to `minute`'s; return those keys' totals over every router
        and how many routers report usage (for each one's share)."""
        ...


class UsageExchange(UsageSink, RateLimitCounters, Protocol):
    """What a router's usage flusher talks to: usage reports, then rate-limit counts."""


class ControlPlaneHub(EndpointSink, UsageSource, ActivationQueue, KeyChangeSink, BudgetReader, Protocol):
    """Everything the reconcile tick needs from the hub."""


class RouterHub(
    EndpointSource, UsageSink, ActivationQueue, KeyChangeSource, RateLimitCounters, BudgetCounters, Protocol
):
    """Everything a router needs from the hub."""
