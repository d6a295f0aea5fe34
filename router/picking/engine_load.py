"""Engines' own load, as each router reads it: waiting requests and KV cache usage from every replica's /metrics.

A poller (one per router, one shared aiohttp session, every replica read at
once with a short timeout) runs every `LLMGW_ENGINE_POLL_SECONDS` beside the
router's other background tasks and writes what it read onto the picker's
endpoints; the pick only reads those cached numbers (DESIGN invariant 4).

| engine    | waiting requests             | KV cache usage (0-1)                                         |
|-----------|------------------------------|--------------------------------------------------------------|
| vLLM      | `vllm:num_requests_waiting`  | `vllm:kv_cache_usage_perc` (older: `vllm:gpu_cache_usage_perc`) |
| SGLang    | `sglang:num_queue_reqs`      | `sglang:token_usage`                                         |
| llama.cpp | `llamacpp:requests_deferred` | `llamacpp:kv_cache_usage_ratio` (older builds only)           |

The bundled mock engine exposes vLLM 0.32's names. llama.cpp's current server
publishes no KV cache gauge at all, so its replicas' KV usage is unknown
(tests/e2e/engines/test_llamacpp.py runs one). Several label sets add up
for the waiting count (vLLM's data-parallel engine cores, SGLang's data-parallel
ranks) and average for KV usage (one full rank of several is not a full
replica); the ranks of one tensor-parallel group (`tp_rank`) report one batch,
so they count once. An engine that does not answer in time, answers anything
but 200, or whose text does not parse has unknown load, which the picker
treats as no extra load and never as "full".

This is the router's own parser, not `agent.engines.load`'s: the router imports
only the hub and itself (tests/test_layers.py), and it reads different gauges.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from router.background import raise_if_cancelling
from router.endpoints.routes import RouteTable
from router.endpoints.table import Endpoint
from router.picking.picker import Picker

log = logging.getLogger(__name__)

WAITING_FAMILIES = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred")
# In order of preference: a vLLM that exposes both names reports the same figure under each.
KV_USAGE_FAMILIES = (
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
    "llamacpp:kv_cache_usage_ratio",
)
SAME_BATCH_LABELS = ("tp_rank",)
METRICS_PATH = "/metrics"
# A vLLM /metrics page with every histogram is tens of KiB; more than this is not a metrics page.
MAX_METRICS_BYTES = 4 * 1024 * 1024
# Only the lines of the gauges we read go through the (pure Python) parser: a full vLLM page
# is hundreds of histogram lines, parsed every second for every replica.
_WANTED = tuple(f"{name}{end}" for name in WAITING_FAMILIES + KV_USAGE_FAMILIES for end in ("{", " "))


@dataclass(frozen=True, slots=True)
class EngineReading:
    """One poll of one engine: waiting requests and KV cache usage (0-1), each None when unknown."""

    waiting: float | None = None
    kv_usage: float | None = None


UNKNOWN = EngineReading()


def parse_engine_load(text: str) -> EngineReading:
    """Waiting requests and KV cache usage from an engine's Prometheus text; unknown parts are None."""
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED))
    # One value per label set, the same-batch labels left out: max within a group.
    groups: dict[str, dict[frozenset[tuple[str, str]], float]] = defaultdict(dict)
    bad: set[str] = set()  # families with a value that is not a count or a fraction: unknown
    try:
        for family in text_string_to_metric_families(wanted):
            for sample in family.samples:
                value = sample.value
                if math.isnan(value) or math.isinf(value) or value < 0:
                    bad.add(sample.name)
                    continue
                key = frozenset((k, v) for k, v in sample.labels.items() if k not in SAME_BATCH_LABELS)
                group = groups[sample.name]
                group[key] = max(group.get(key, 0.0), value)
    except ValueError:  # the parser's only complaint: not Prometheus text exposition
        return UNKNOWN
    waiting = kv_usage = None
    name = _first_present(WAITING_FAMILIES, groups, bad)
    if name is not None and name not in bad:
        waiting = sum(groups[name].values())
    name = _first_present(KV_USAGE_FAMILIES, groups, bad)
    if name is not None and name not in bad:
        values = groups[name].values()
        kv_usage = min(1.0, sum(values) / len(values))
    return EngineReading(waiting, kv_usage)


def _first_present(names: tuple[str, ...], groups: dict[str, Any], bad: set[str]) -> str | None:
    return next((name for name in names if name in groups or name in bad), None)


class EngineLoadPoller:
    """Reads every published replica's /metrics every `poll_seconds` and records it for the picker.

    `run()` is a background task: it opens its session, polls until
    cancelled, and closes the session on the way out.
    """

    def __init__(
        self, routes: RouteTable, picker: Picker, poll_seconds: float | None = None, timeout: float | None = None
    ):
        self.routes = routes
        self.picker = picker
        if poll_seconds is None:
            poll_seconds = float(settings.LLMGW_ENGINE_POLL_SECONDS)
        self.poll_seconds = poll_seconds
        if self.poll_seconds <= 0:
            raise ValueError("the engine poll interval must be > 0 seconds")
        # A slow engine must not hold back the next round of every other replica's reading.
        self.timeout = min(self.poll_seconds, 1.0) if timeout is None else timeout
        self._session: aiohttp.ClientSession | None = None
        # Told after each round: engines whose queues emptied have room for a full model's waiting requests.
        self.polled: Callable[[], None] | None = None

    def open(self) -> None:
        """Open the poller's HTTP session (on the router's loop)."""
        self._session = aiohttp.ClientSession(
            # Reads run at once but not unbounded: a large fleet is read in waves of this many.
            connector=aiohttp.TCPConnector(limit=64, keepalive_timeout=max(4.0, 2 * self.poll_seconds)),
            timeout=aiohttp.ClientTimeout(total=self.timeout),
        )

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def run(self) -> None:
        """Poll every `poll_seconds` until cancelled; the session lives as long as this task."""
        loop = asyncio.get_running_loop()
        self.open()
        try:
            while True:
                started = loop.time()
                try:
                    await self.poll_once()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    raise_if_cancelling()
                    log.exception("engine load poll failed")
                await asyncio.sleep(max(0.0, self.poll_seconds - (loop.time() - started)))
        finally:
            await self.close()

    async def poll_once(self, endpoints: Iterable[Endpoint] | None = None) -> None:
        """Read every replica (or those given) at once and record each reading on its endpoint."""
        targets = list(self.routes.endpoints() if endpoints is None else endpoints)
        if not targets:
            return
        readings = await asyncio.gather(*(self.read(e.url, e.authorization) for e in targets))
        record = self.picker.record_engine_load
        for endpoint, reading in zip(targets, readings, strict=True):
            record(endpoint, reading.waiting, reading.kv_usage)
        if self.polled is not None:
            self.polled()

    async def read(self, url: str, headers: dict[str, str] | None = None) -> EngineReading:
        """One engine's load; UNKNOWN when it cannot be read in time or makes no sense. `headers`: the engine's
        own Authorization, if it has a key (llama.cpp's `--api-key` guards /metrics too)."""
        session = self._session
        if session is None:
            raise RuntimeError("the engine load poller is not running")
        chunks: list[bytes] = []
        size = 0
        try:
            async with session.get(url + METRICS_PATH, headers=headers) as response:
                if response.status != 200:
                    return UNKNOWN
                async for chunk in response.content.iter_chunked(64 * 1024):
                    size += len(chunk)
                    if size > MAX_METRICS_BYTES:
                        return UNKNOWN
                    chunks.append(chunk)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return UNKNOWN
        return parse_engine_load(b"".join(chunks).decode("utf-8", "replace"))
