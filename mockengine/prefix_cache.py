"""The mock engine's prefix cache, as vLLM's automatic prefix caching keeps one: full blocks of 16 prompt tokens,
each keyed by a hash chained over every token before it, the least recently used dropped first.

A prompt's cached part is its leading blocks found in the cache; only the rest is computed, and with
`--uncached-token-ms` that takes that long per uncached token before the first token comes out, so a request
sent where its prefix is cached answers sooner. The counters are vLLM's (`vllm:prefix_cache_queries_total`,
`vllm:prefix_cache_hits_total`: prompt tokens looked up, and found). `POST /reset_prefix_cache` (with the sleep
routes, development mode) empties it. A mock token is a word, and a chat message's role is one token before it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Hashable, Sequence

BLOCK_TOKENS = 16


class MockPrefixCache:
    """Cached blocks (LRU, `capacity_tokens` at most) and the hit counters; capacity 0: no cache at all."""

    def __init__(self, capacity_tokens: int = 0, uncached_token_ms: float = 0.0) -> None:
        self.capacity = capacity_tokens // BLOCK_TOKENS
        self.uncached_token_delay = uncached_token_ms / 1000.0
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def look_up(self, tokens: Sequence[Hashable]) -> int:
        """How many leading tokens of `tokens` are cached; then every full block of it is (most recent last)."""
        self.queries += len(tokens)
        if not self.capacity:
            return 0
        cached, value, missed = 0, 0, False
        blocks = self._blocks
        for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            value = hash((value, *tokens[start : start + BLOCK_TOKENS]))
            if not missed and value in blocks:
                cached += BLOCK_TOKENS
            else:
                missed = True
            blocks[value] = None
            blocks.move_to_end(value)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
        self.hits += cached
        return cached

    async def prefill(self, tokens: Sequence[Hashable]) -> None:
        """Look `tokens` up, and take the time computing the uncached part takes."""
        uncached = len(tokens) - self.look_up(tokens)
        if self.uncached_token_delay and uncached:
            await asyncio.sleep(uncached * self.uncached_token_delay)

    def reset(self) -> None:
        self._blocks.clear()

    def metric_lines(self, label: str) -> list[str]:
        """vLLM's two prefix-cache counters; `label` is the engine's `{engine=…,model_name=…}` set."""
        lines = []
        for name, text, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", self.queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", self.hits),
        ):
            total = f"{name}_total"  # the text format names a counter with its suffix, as vLLM's server does
            lines += [f"# HELP {total} {text}", f"# TYPE {total} counter", f"{total}{label} {float(value)}"]
        return lines
