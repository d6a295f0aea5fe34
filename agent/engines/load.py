"""How busy an engine is, by its own Prometheus /metrics: the requests it holds right now.

A request counts from the moment the engine accepts it until it has answered,
so both the running and the queued gauges count (stopping an engine with a
queued request loses that request as surely as a running one):

| engine    | running                        | queued                        |
|-----------|--------------------------------|-------------------------------|
| vLLM      | `vllm:num_requests_running`    | `vllm:num_requests_waiting`   |
| SGLang    | `sglang:num_running_reqs`      | `sglang:num_queue_reqs`       |
| llama.cpp | `llamacpp:requests_processing` | `llamacpp:requests_deferred`  |

The bundled mock engine exposes vLLM's names. Label sets add up (vLLM's data-
parallel engine cores, SGLang's data-parallel ranks), except that the ranks of
one tensor-parallel group report the same batch, so those count once.

Unknown is not idle (DESIGN invariant 3): a body without any running gauge,
an unreadable body or an engine that does not answer in time reads as None.
So does a running gauge declared without a value, with one exception: SGLang
gives its gauges a value only at its first batch, so an SGLang that has not
served a request yet (its request and token counters declared, none above 0)
reads as 0. Only a request inside that very first batch is not seen.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Families whose samples are requests the engine holds. The running gauge of
# at least one engine must be present for the count to be known.
RUNNING_FAMILIES = ("vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing")
QUEUED_FAMILIES = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred")
# SGLang's counters of requests served (family names, as the parser gives them without `_total`): declared
# and all 0 or without a value, they say the engine has served nothing, so its valueless gauges mean 0.
SERVED_COUNTERS = ("sglang:num_requests", "sglang:prompt_tokens", "sglang:generation_tokens")
# Label naming the rank inside a tensor-parallel group (SGLang): its samples repeat one batch.
SAME_BATCH_LABELS = ("tp_rank",)

POLL_TIMEOUT_SECONDS = 1.0


def requests_in_flight(text: str) -> int | None:
    """The requests an engine holds (running + queued) from its /metrics text; None if the text does not say."""
    counted = set(RUNNING_FAMILIES + QUEUED_FAMILIES)
    found: set[str] = set()
    # Whether SGLang's served counters are declared, and whether any of them is above 0.
    declares_served = has_served = False
    # One value per label set, with the same-batch labels left out: max within, sum across.
    groups: dict[tuple[str, frozenset], float] = defaultdict(float)
    try:
        for family in text_string_to_metric_families(text):
            if family.name in SERVED_COUNTERS and family.type == "counter":
                declares_served = True
                has_served = has_served or any(s.value != 0 for s in family.samples if s.name.endswith("_total"))
                continue
            if family.name not in counted:
                continue
            found.add(family.name)
            for sample in family.samples:
                if sample.name != family.name:
                    continue
                value = sample.value
                if math.isnan(value) or math.isinf(value) or value < 0:
                    return None
                labels = frozenset((k, v) for k, v in sample.labels.items() if k not in SAME_BATCH_LABELS)
                key = (family.name, labels)
                groups[key] = max(groups[key], value)
    except ValueError:  # the parser's only complaint: not Prometheus text exposition
        return None
    if not found & set(RUNNING_FAMILIES):
        return None
    # A running family with no samples yet is an engine that has not reported a batch: not known, unless
    # it says it has served nothing (every served counter it declares at 0), which only SGLang's does.
    if not any(name in RUNNING_FAMILIES for name, _ in groups) and (has_served or not declares_served):
        return None
    return round(sum(groups.values()))


class EngineLoad:
    """Reads engines' requests in flight over HTTP where each listens (127.0.0.1 unless told), with one shared client.

    Every read is bounded by `timeout` seconds in all, so a slow engine delays
    a heartbeat by at most that. Call `aclose()` when done.
    """

    def __init__(self, timeout: float = POLL_TIMEOUT_SECONDS):
        self.timeout = timeout
        # trust_env=False: an HTTP proxy from the environment must not sit between the agent and its engines.
        self._client = httpx.AsyncClient(trust_env=False, timeout=timeout)

    async def read(self, port: int, metrics_path: str | None, host: str = "127.0.0.1") -> int | None:
        """The requests the engine on `port` holds; None without a metrics path or when it cannot be read in time."""
        if metrics_path is None:
            return None
        try:
            async with asyncio.timeout(self.timeout):
                response = await self._client.get(f"http://{host}:{port}{metrics_path}")
        except (httpx.HTTPError, TimeoutError):
            return None
        if response.status_code != 200:
            return None
        return requests_in_flight(response.text)

    async def read_many(self, targets: dict[int, tuple]) -> dict[int, int | None]:
        """Read several engines at once: {key: (port, metrics path[, URL host])} to {key: requests or None}."""
        keys = list(targets)
        counts = await asyncio.gather(*(self.read(*targets[key]) for key in keys))
        return dict(zip(keys, counts, strict=True))

    async def aclose(self) -> None:
        await self._client.aclose()
