"""Counters routers report and the hub adds up until the control plane takes them: requests, tokens and spend
per key and model (`TokenCount`), answers whose engine broke off per model (`ContinuationCount`), and tokens per
replica and key (`ReplicaTokens`, what the showback attributes each replica's GPU time by). All per hour.

Re-exported by hub.contracts, where the hub's contracts are read from.
"""

from __future__ import annotations

import msgspec

from hub.records import NonNegative


class TokenCount(msgspec.Struct, kw_only=True, array_like=True):
    """Requests and tokens of one key on one model, and what they cost; `[requests, prompt, completion, spend]` on
    the wire (an older router's three fields read as no spend; an older hub reads the first three). Counters.

    `spend` is in hub.budgets.SPEND_UNITS (10^-12 of the currency unit): each answer's tokens at the prices of the
    endpoint table that served it, counted once, by the router that relayed it or by the budgets' settlement."""

    requests: NonNegative
    prompt: NonNegative
    completion: NonNegative
    spend: NonNegative = 0

    def add(self, other: TokenCount) -> None:
        """Add `other`'s counts to these."""
        self.requests += other.requests
        self.prompt += other.prompt
        self.completion += other.completion
        self.spend += other.spend


TokenCounts = dict[str, dict[str, TokenCount]]
"""API-key digest (`hub.credentials.hash_secret`) -> public model name -> its counts."""

HOUR = 3600


def hour_of(ts: float) -> int:
    """The start (Unix seconds, UTC) of the hour `ts` falls in: token counts are kept per hour."""
    return int(ts // HOUR) * HOUR


def add_token_counts(into: TokenCounts, counts: TokenCounts) -> None:
    """Add `counts` to `into` (copies, so later additions to one never change the other)."""
    for digest, models in counts.items():
        per_key = into.setdefault(digest, {})
        for model, count in models.items():
            total = per_key.get(model)
            if total is None:
                per_key[model] = TokenCount(
                    requests=count.requests, prompt=count.prompt, completion=count.completion, spend=count.spend
                )
            else:
                total.add(count)


class ContinuationCount(msgspec.Struct, kw_only=True, array_like=True):
    """Answers of one model whose engine broke off, by what became of them, and the prompt tokens engines re-read
    to continue them; `[continued, failed, refused, reprocessed]` on the wire. Counters: each break counts once,
    as in the router's `llmgw_router_stream_continuations_total` (a stream continued twice counts twice)."""

    continued: NonNegative
    """The client had its whole answer: continued on another replica, a whole answer asked of another, or a
    stream that lacked only its end."""
    failed: NonNegative
    """Ended with an error: no other replica to go on, or LLMGW_STREAM_MIGRATIONS reached."""
    refused: NonNegative
    """Ended with an error because going on would change the answer (n > 1, guided, logprobs, a tool call…)."""
    reprocessed: NonNegative
    """Prompt tokens engines read again to continue them: no client's usage."""

    def add(self, other: ContinuationCount) -> None:
        """Add `other`'s counts to these."""
        self.continued += other.continued
        self.failed += other.failed
        self.refused += other.refused
        self.reprocessed += other.reprocessed


ContinuationCounts = dict[str, ContinuationCount]
"""Public model name -> its broken answers' counts."""


def add_continuation_counts(into: ContinuationCounts, counts: ContinuationCounts) -> None:
    """Add `counts` to `into` (copies, so later additions to one never change the other)."""
    for model, count in counts.items():
        total = into.get(model)
        if total is None:
            into[model] = ContinuationCount(**msgspec.structs.asdict(count))
        else:
            total.add(count)


ReplicaTokens = dict[str, dict[str, int]]
"""Replica id -> API-key digest -> tokens (prompt and completion) it served that key: each key's share of the
replica's work, by which the showback divides the replica's GPU time (keys.showback)."""


def add_replica_tokens(into: ReplicaTokens, counts: ReplicaTokens) -> None:
    """Add `counts` to `into` (copies, as `add_token_counts`)."""
    for replica, keys in counts.items():
        per_replica = into.setdefault(replica, {})
        for digest, tokens in keys.items():
            per_replica[digest] = per_replica.get(digest, 0) + tokens
