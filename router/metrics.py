"""Prometheus metrics of one router app, in a registry of its own.

A registry per app (not the process-wide default) lets the embedded `up`
command and tests run several routers in one process without clashes.
Labels only ever carry published model names, never what a client typed, so
a client cannot blow up the label cardinality. Ejection figures and the
engines' polled load are read from the picker and the route table when scraped, so requests pay
nothing for them; what requests themselves add (answers by status, requests in
flight, upstream latency, a stream's time to first token and the gaps between
its chunks, how long held requests waited) is kept in plain numbers (`Traffic`,
`Histogram`) that a scrape turns into metric families, so a request pays a dict
update, not a labelled child lookup and a lock per figure.
"""

from __future__ import annotations

import hmac
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client import Histogram as LabelledHistogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from hub.windows import FIRST_TOKEN_BUCKETS, INTER_TOKEN_BUCKETS
from router.endpoints.routes import RouteTable
from router.picking.picker import Picker

UNKNOWN_MODEL = "-"
UPSTREAM_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# What a continued stream's client waits between the last chunk of the broken leg and the first of the next: 50 ms
# steps up to half a second, where a lost replica's streams land when the fleet has room.
CONTINUATION_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
HOLD_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 900)
# Why a request was held (`llmgw_router_hold_seconds`): a start unless the table says `wake` or `making_room`
# (for a LoRA adapter whose base runs, its load: router.endpoints.routes.ADAPTER_LOAD).
COLD_START = "cold_start"


def metrics_token_ok(headers: Iterable[tuple[bytes, bytes]], token: str) -> bool:
    """Whether a scrape may read /metrics: always without a token, else only with `Authorization: Bearer <token>`.

    Compared in constant time, so the answer's timing does not reveal how much of a guess was right.
    """
    if not token:
        return True
    for name, value in headers:
        if name == b"authorization":
            scheme, _, given = value.partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token.encode())
    return False


class RouterMetrics:
    """The router's counters, histogram and gauges."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, routes: RouteTable | None = None, picker: Picker | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Answers, requests in flight, latencies and holds: counted by requests, so kept plain.
        self.traffic = Traffic()
        self.registry.register(self.traffic)
        self.activations = Counter(
            "llmgw_router_activations",
            "Activation requests sent to the control plane, by model.",
            ["model"],
            registry=self.registry,
        )
        self.retries = Counter(
            "llmgw_router_retries",
            "Requests retried on another replica before the first byte.",
            ["model"],
            registry=self.registry,
        )
        self.usage_flush_failures = Counter(
            "llmgw_router_usage_flush_failures",
            "Last-use flushes the usage store refused (stamps kept for the next).",
            registry=self.registry,
        )
        # Streams whose engine broke off (router.forwarding.resume): few, so labelled children are cheap enough.
        self.continuations = Counter(
            "llmgw_router_stream_continuations",
            "Streams whose engine broke off after the answer began, by why (reason) and what became of them "
            "(outcome: continued on another replica, or why not).",
            ["model", "reason", "outcome"],
            registry=self.registry,
        )
        self.continuation_gap = LabelledHistogram(
            "llmgw_router_stream_continuation_gap_seconds",
            "The pause a continued stream's client saw: from the last chunk before the break to the next replica's first.",
            ["model"],
            buckets=CONTINUATION_GAP_BUCKETS,
            registry=self.registry,
        )
        self.reprocessed_prompt_tokens = Counter(
            "llmgw_router_continuation_prompt_tokens",
            "Prompt tokens engines read again to continue streams (the original prompt and what was already "
            "generated): the cost of continuations, not counted as any client's usage.",
            ["model"],
            registry=self.registry,
        )
        if routes is not None and picker is not None:
            self.registry.register(EjectionCollector(routes, picker))
            self.registry.register(EngineLoadCollector(routes))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Histogram:
    """One Prometheus histogram kept as plain numbers: per label values, a count per bucket and a sum of values.

    `key` is the one label's value, or a tuple of the values when there are several. A value equal to a
    bound counts in that bound's bucket (`le`). A loop that observes many values of one key takes its
    `series(key)` once and counts into it itself, so each value costs it a bisect and two additions, not a
    call: `counts[bisect_left(bounds, value)] += 1` and `series[1] += value`.
    """

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...], bounds: tuple[float, ...]) -> None:
        self.name, self.documentation, self.labels, self.bounds = name, documentation, labels, bounds
        # key -> [count per bucket (the last one is +Inf), sum of values]
        self._series: dict[Any, list[Any]] = {}

    def series(self, key: Any) -> list[Any]:
        """`[count per bucket (the last one is +Inf), sum of values]` of `key`, made if new."""
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = self.blank()
        return series

    def blank(self) -> list[Any]:
        """A series that counts nothing yet, kept nowhere: for a loop whose values turn out not to count."""
        return [[0] * (len(self.bounds) + 1), 0.0]

    def counts(self) -> dict[Any, tuple[int, ...]]:
        """Key -> its count per bucket so far (a copy)."""
        return {key: tuple(series[0]) for key, series in self._series.copy().items()}

    def observe(self, key: Any, value: float) -> None:
        series = self._series.get(key)
        if series is None:  # once per key: no call on every request's way
            series = self.series(key)
        series[0][bisect_left(self.bounds, value)] += 1
        series[1] += value

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        bounds = [*(repr(float(bound)) for bound in self.bounds), "+Inf"]
        # A copy: a scrape from another thread must not see the dict change under it.
        for key, (counts, total) in sorted(self._series.copy().items()):
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric(list(key) if isinstance(key, tuple) else [key], buckets, total)
        return family


class Traffic(Collector):
    """What requests add to the metrics, as plain numbers on the router's event loop, collected when scraped.

    `answered(model, status)` counts an answer, `in_flight` is the number of
    requests being proxied, `upstream_latency(model, seconds)` records the time
    to an engine's response headers, `held(model, reason, seconds)` a request's
    hold; the proxy times a stream's first token and the gaps between its chunks
    into `first_token` and `inter_token`.
    """

    def __init__(self) -> None:
        self.answers: dict[tuple[str, int], int] = {}
        self.in_flight = 0
        self.latency = Histogram(
            "llmgw_router_upstream_latency_seconds",
            "Time from sending a request to an engine to its response headers.",
            ("model",),
            UPSTREAM_LATENCY_BUCKETS,
        )
        self.first_token = Histogram(
            "llmgw_router_time_to_first_token_seconds",
            "Time from receiving a streamed (SSE) request, any hold included, to relaying the first chunk of its "
            "answer to the client. Answers that are not streamed are not observed.",
            ("model",),
            FIRST_TOKEN_BUCKETS,
        )
        self.inter_token = Histogram(
            "llmgw_router_inter_token_seconds",
            "Gaps between consecutive chunks of a streamed (SSE) answer relayed to the client, one per gap.",
            ("model",),
            INTER_TOKEN_BUCKETS,
        )
        self.hold = Histogram(
            "llmgw_router_hold_seconds",
            "How long a request was held waiting for a replica, observed when the hold ended (served, refused, "
            "timed out or the client left), by why: cold_start, wake (only sleepers), making_room or adapter_load "
            "(a LoRA adapter waiting to be loaded on a running replica of its base).",
            ("model", "reason"),
            HOLD_BUCKETS,
        )
        # Bound once: the one figure every request records.
        self.upstream_latency = self.latency.observe

    def answered(self, model: str, status: int) -> None:
        key = (model, status)
        answers = self.answers
        answers[key] = answers.get(key, 0) + 1

    def held(self, model: str, reason: str, seconds: float) -> None:
        self.hold.observe((model, reason), seconds)

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "llmgw_router_requests",
            "Requests answered, by public model name and HTTP status code.",
            labels=["model", "code"],
        )
        # A copy: a scrape from another thread must not see the dict change under it.
        for (model, status), count in sorted(self.answers.copy().items()):
            requests.add_metric([model, str(status)], count)
        yield requests
        for histogram in (self.latency, self.first_token, self.inter_token, self.hold):
            yield histogram.family()
        in_flight = GaugeMetricFamily("llmgw_router_in_flight_requests", "Requests being proxied right now.")
        in_flight.add_metric([], self.in_flight)
        yield in_flight


class EjectionCollector(Collector):
    """Outlier ejection as the picker counts it: ejections so far and replicas ejected now, per model."""

    def __init__(self, routes: RouteTable, picker: Picker) -> None:
        self.routes = routes
        self.picker = picker

    def collect(self) -> Iterator[Metric]:
        picker = self.picker
        ejections = CounterMetricFamily(
            "llmgw_router_ejections",
            "Replicas ejected after consecutive failures (or a failed probe), by model.",
            labels=["model"],
        )
        for model, count in sorted(picker.ejection_counts().items()):
            ejections.add_metric([model], count)
        yield ejections
        now = dict.fromkeys(self.routes.catalog(), 0)
        for endpoint in picker.ejected():
            now[endpoint.model] = now.get(endpoint.model, 0) + 1
        ejected = GaugeMetricFamily(
            "llmgw_router_ejected_replicas",
            "Replicas ejected right now (cooling down or awaiting their probe), by model.",
            labels=["model"],
        )
        for model, count in sorted(now.items()):
            ejected.add_metric([model], count)
        yield ejected


class EngineLoadCollector(Collector):
    """The engines' own load as this router last polled it, per replica; replicas whose figure is unknown are left out."""

    def __init__(self, routes: RouteTable) -> None:
        self.routes = routes

    def collect(self) -> Iterator[Metric]:
        waiting = GaugeMetricFamily(
            "llmgw_router_engine_waiting_requests",
            "Requests waiting in the engine's own queue, as last polled from its /metrics.",
            labels=["model", "replica"],
        )
        kv_usage = GaugeMetricFamily(
            "llmgw_router_engine_kv_cache_usage_ratio",
            "The engine's KV cache usage (1 = full), as last polled from its /metrics.",
            labels=["model", "replica"],
        )
        for endpoint in sorted(self.routes.endpoints(), key=lambda e: (e.model, e.replica_id)):
            labels = [endpoint.model, endpoint.replica_id]
            if endpoint.engine_waiting is not None:
                waiting.add_metric(labels, endpoint.engine_waiting)
            if endpoint.kv_usage is not None:
                kv_usage.add_metric(labels, endpoint.kv_usage)
        yield waiting
        yield kv_usage
