"""Token usage per API key, model and hour, stored from what the tick took from the hub.

Routers count requests and tokens per key digest and model (router.accounting.usage_reader);
the hub adds their counts up per hour until the tick takes them in one step
(`collect_usage`). This module hands what was taken to `keys.usage.store_tokens`
(which adds it to `keys.models.TokenUsage` in a fixed number of queries, so two
leaders storing what each took at once still add up). When the database
refuses, the counts go back to the hub for the next tick instead of being lost.
"""

from __future__ import annotations

import logging

from hub.contracts import UsageSnapshot, UsageSource
from keys.usage import store_tokens

log = logging.getLogger(__name__)


def record_token_usage(snapshot: UsageSnapshot | None, hub: UsageSource) -> int:
    """Store the tokens and keys' last use in this tick's snapshot; give them back to the hub if that fails.

    Returns the number of (key, model, hour) rows added to.
    """
    if snapshot is None or not (snapshot.tokens or snapshot.keys):
        return 0
    try:
        return store_tokens(snapshot.tokens, snapshot.keys)
    except Exception as exc:
        log.warning("could not store token usage, giving it back to the hub for the next tick: %s", exc)
        try:
            hub.restore_tokens(snapshot.tokens, snapshot.keys)
        except Exception as again:
            log.error("token usage lost: the database refused it and the hub could not take it back: %s", again)
        return 0
