"""Token usage per API key, model and hour (and per replica and key: the showback's shares), and answers whose
engine broke off per model and hour, stored from what the tick took from the hub.

Routers count requests and tokens per key digest and model (router.accounting.usage_reader), and broken answers
per model (router.accounting.continuations); the hub adds their counts up per hour until the tick takes them in one
step (`collect_usage`). This module hands what was taken to `keys.usage.store_tokens` and
`keys.usage.store_continuations` (which add it to `keys.models.TokenUsage` and `ContinuationHour` in a fixed
number of queries, so two leaders storing what each took at once still add up). When the database refuses, the
counts go back to the hub for the next tick instead of being lost.
"""

from __future__ import annotations

import logging

from hub.contracts import UsageSnapshot, UsageSource
from keys.records import record_requests
from keys.usage import store_continuations, store_tokens

log = logging.getLogger(__name__)


def record_token_usage(snapshot: UsageSnapshot | None, hub: UsageSource) -> int:
    """Store the tokens, keys' last use and continuation counts in this tick's snapshot; give back to the hub
    whatever the database refuses.

    Returns the number of (key, model, hour) token rows added to.
    """
    record_requests(hub)  # the per-request log, when it is kept (keys.records)
    if snapshot is None:
        return 0
    if snapshot.continuations:
        _record_continuations(snapshot, hub)
    if not (snapshot.tokens or snapshot.keys or snapshot.replica_tokens):
        return 0
    try:
        return store_tokens(snapshot.tokens, snapshot.keys, snapshot.replica_tokens)
    except Exception as exc:
        log.warning("could not store token usage, giving it back to the hub for the next tick: %s", exc)
        try:
            hub.restore_tokens(snapshot.tokens, snapshot.keys, snapshot.replica_tokens)
        except Exception as again:
            log.error("token usage lost: the database refused it and the hub could not take it back: %s", again)
        return 0


def _record_continuations(snapshot: UsageSnapshot, hub: UsageSource) -> None:
    """Store the snapshot's continuation counts, apart from its tokens: either may fail without the other."""
    try:
        store_continuations(snapshot.continuations)
    except Exception as exc:
        log.warning("could not store continuation counts, giving them back to the hub for the next tick: %s", exc)
        try:
            hub.restore_continuations(snapshot.continuations)
        except Exception as again:
            log.error(
                "continuation counts lost: the database refused them and the hub could not take them back: %s", again
            )
