"""The hub's counters as Redis hash fields, and back: token counts, tokens per replica and continuation counts,
per hour. Routers add to the fields with HINCRBY; the tick takes the whole hash and parses it here.

* tokens: `<kind> <hour> <key digest> <model>` (a kind per field of TokenCount; the model last, as it may contain
  spaces), and `replica <hour> <key digest> <replica id>` for tokens per replica, in the same hash so that one
  step takes both;
* continuations: `<kind> <hour> <model>`, a kind per field of ContinuationCount.
"""

from __future__ import annotations

import logging

import msgspec

from hub.counts import ContinuationCount, ContinuationCounts, ReplicaTokens, TokenCount, TokenCounts

log = logging.getLogger(__name__)

TOKEN_KINDS = ("requests", "prompt", "completion", "spend")
REPLICA_KIND = "replica"
CONTINUATION_KINDS = tuple(f.name for f in msgspec.structs.fields(ContinuationCount))


def token_fields(hour: int, tokens: TokenCounts, replicas: ReplicaTokens | None = None) -> dict[str, int]:
    """The counter increments for one hour's counts (zeros left out: HINCRBY by 0 is a wasted command). Tokens per
    replica share the hash (`replica <hour> <digest> <replica id>`), so one step takes both."""
    fields = {}
    for digest, models in tokens.items():
        for model, count in models.items():
            for kind, amount in zip(TOKEN_KINDS, msgspec.structs.astuple(count), strict=True):
                if amount:
                    fields[f"{kind} {hour} {digest} {model}"] = amount
    for replica, keys in (replicas or {}).items():
        for digest, amount in keys.items():
            if amount:
                fields[f"{REPLICA_KIND} {hour} {digest} {replica}"] = amount
    return fields


def parse_token_fields(raw: dict[bytes, bytes]) -> tuple[dict[int, TokenCounts], dict[int, ReplicaTokens]]:
    """Counter fields back into {hour: {digest: {model: TokenCount}}} and {hour: {replica: {digest: tokens}}};
    malformed ones logged and dropped."""
    tokens: dict[int, TokenCounts] = {}
    replicas: dict[int, ReplicaTokens] = {}
    for field_name, value in raw.items():
        try:
            kind, hour, digest, model = field_name.decode().split(" ", 3)
            amount = int(value)
            if kind == REPLICA_KIND:
                per_replica = replicas.setdefault(int(hour), {}).setdefault(model, {})
                per_replica[digest] = per_replica.get(digest, 0) + amount
                continue
            if kind not in TOKEN_KINDS:
                raise ValueError(kind)
            count = (
                tokens.setdefault(int(hour), {})
                .setdefault(digest, {})
                .setdefault(model, TokenCount(requests=0, prompt=0, completion=0))
            )
            setattr(count, kind, getattr(count, kind) + amount)
        except ValueError:
            log.warning("dropping a malformed token counter %r=%r", field_name, value)
    return tokens, replicas


def continuation_fields(hour: int, counts: ContinuationCounts) -> dict[str, int]:
    """The counter increments for one hour's continuation counts (zeros left out, as for tokens)."""
    return {
        f"{kind} {hour} {model}": amount
        for model, count in counts.items()
        for kind, amount in zip(CONTINUATION_KINDS, msgspec.structs.astuple(count), strict=True)
        if amount
    }


def parse_continuation_fields(raw: dict[bytes, bytes]) -> dict[int, ContinuationCounts]:
    """Counter fields back into {hour: {model: ContinuationCount}}; malformed ones logged and dropped."""
    taken: dict[int, ContinuationCounts] = {}
    for field_name, value in raw.items():
        try:
            kind, hour, model = field_name.decode().split(" ", 2)
            if kind not in CONTINUATION_KINDS:
                raise ValueError(kind)
            amount = int(value)
            count = taken.setdefault(int(hour), {}).setdefault(
                model, ContinuationCount(continued=0, failed=0, refused=0, reprocessed=0)
            )
            setattr(count, kind, getattr(count, kind) + amount)
        except ValueError:
            log.warning("dropping a malformed continuation counter %r=%r", field_name, value)
    return taken
