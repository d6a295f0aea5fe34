"""The mock engine's prefix cache (mockengine/prefix_cache.py): blocks chained as vLLM's, LRU, vLLM's counters,
and a first token that waits for the uncached part of the prompt."""

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mockengine.prefix_cache import BLOCK_TOKENS, MockPrefixCache
from mockengine.tests.test_server import MODEL
from mockengine.tests.test_sleep import launch


def tokens(word: str, blocks: int, extra: int = 0) -> list[str]:
    return [f"{word}{i}" for i in range(blocks * BLOCK_TOKENS + extra)]


def test_a_prompt_finds_the_leading_full_blocks_an_earlier_one_left():
    cache = MockPrefixCache(capacity_tokens=1000)
    first = tokens("w", 2, extra=5)  # two full blocks and a partial one (never cached)
    assert cache.look_up(first) == 0
    assert cache.look_up(first + ["more"] * 30) == 2 * BLOCK_TOKENS
    # Only a leading run counts: a different first block makes everything after it a miss.
    assert cache.look_up(["other"] + first[1:]) == 0
    assert (cache.queries, cache.hits) == (37 + 67 + 37, 32)


def test_the_least_recently_used_blocks_go_first_and_no_capacity_caches_nothing():
    cache = MockPrefixCache(capacity_tokens=2 * BLOCK_TOKENS)
    a, b = tokens("a", 2), tokens("b", 2)
    cache.look_up(a)
    cache.look_up(b)  # a's blocks pushed out
    assert cache.look_up(a) == 0
    assert cache.look_up(a) == 2 * BLOCK_TOKENS
    none = MockPrefixCache()
    none.look_up(a)
    assert none.look_up(a) == 0 and none.queries == 2 * len(a)


def counters(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics").text
    return {
        f.name: sum(s.value for s in f.samples if s.name.endswith("_total"))
        for f in text_string_to_metric_families(text)
        if f.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
    }


@pytest.fixture
def cached_engine():
    proc, base = launch("--prefix-cache-tokens", "4096", "--uncached-token-ms", "25")  # with vLLM's reset route
    yield base
    proc.terminate()
    proc.wait(5)


def test_the_engine_answers_sooner_where_the_prefix_is_cached_and_counts_as_vllm_does(cached_engine):
    history = " ".join(f"word{i}" for i in range(63))  # with its role: 64 tokens, four full blocks
    body = {"model": MODEL, "messages": [{"role": "user", "content": history}], "max_tokens": 1}
    timings = []
    for _ in range(2):
        began = time.perf_counter()
        assert httpx.post(cached_engine + "/v1/chat/completions", json=body, timeout=10).status_code == 200
        timings.append(time.perf_counter() - began)
    # 64 uncached tokens at 25 ms (1.6 s), then none: the second is sooner by most of that, whatever else a loaded
    # machine adds to both.
    assert timings[0] >= 1.6 and timings[0] - timings[1] >= 1.2
    assert counters(cached_engine) == {"vllm:prefix_cache_queries": 128.0, "vllm:prefix_cache_hits": 64.0}
    # vLLM's reset route (development mode) empties it.
    assert httpx.post(cached_engine + "/reset_prefix_cache").json() == {"success": True}
    httpx.post(cached_engine + "/v1/chat/completions", json=body, timeout=10)
    assert counters(cached_engine)["vllm:prefix_cache_hits"] == 64.0
