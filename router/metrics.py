"""Prometheus metrics of one router app, in a registry of its own.

A registry per app (not the process-wide default) lets the embedded `up`
command and tests run several routers in one process without clashes.
Labels only ever carry published model names, never what a client typed, so
a client cannot blow up the label cardinality. Ejection figures and the
engines' polled load are read from the balancer when scraped, so requests pay
nothing for them; what requests themselves add (answers by status, requests in
flight, upstream latency) is kept in plain numbers (`Traffic`) that a scrape
turns into metric families, so a request pays a dict update, not a labelled
child lookup and a lock per figure.
"""

from __future__ import annotations

import hmac
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from .balancer import Balancer

UNKNOWN_MODEL = "-"
UPSTREAM_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


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

    def __init__(self, balancer: Balancer | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Answers, requests in flight and upstream latency: counted by every request, so kept plain.
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
        if balancer is not None:
            self.registry.register(EjectionCollector(balancer))
            self.registry.register(EngineLoadCollector(balancer))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Traffic(Collector):
    """What requests add to the metrics, as plain numbers on the router's event loop, collected when scraped.

    `answered(model, status)` counts an answer, `in_flight` is the number of
    requests being proxied, `upstream_latency(model, seconds)` records the time
    to an engine's response headers in the buckets of UPSTREAM_LATENCY_BUCKETS.
    """

    def __init__(self) -> None:
        self.answers: dict[tuple[str, int], int] = {}
        self.in_flight = 0
        # model -> [count per bucket (the last one is +Inf), sum of seconds]
        self._latency: dict[str, list[Any]] = {}

    def answered(self, model: str, status: int) -> None:
        key = (model, status)
        answers = self.answers
        answers[key] = answers.get(key, 0) + 1

    def upstream_latency(self, model: str, seconds: float) -> None:
        histogram = self._latency.get(model)
        if histogram is None:
            histogram = self._latency[model] = [[0] * (len(UPSTREAM_LATENCY_BUCKETS) + 1), 0.0]
        # bisect_left: a value equal to a bound belongs to that bound's bucket (`le`).
        histogram[0][bisect_left(UPSTREAM_LATENCY_BUCKETS, seconds)] += 1
        histogram[1] += seconds

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "llmgw_router_requests",
            "Requests answered, by public model name and HTTP status code.",
            labels=["model", "code"],
        )
        # Copies: a scrape from another thread must not see the dicts change under it.
        for (model, status), count in sorted(self.answers.copy().items()):
            requests.add_metric([model, str(status)], count)
        yield requests
        latency = HistogramMetricFamily(
            "llmgw_router_upstream_latency_seconds",
            "Time from sending a request to an engine to its response headers.",
            labels=["model"],
        )
        for model, (counts, total) in sorted(self._latency.copy().items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*UPSTREAM_LATENCY_BUCKETS, float("inf")), counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
            latency.add_metric([model], buckets, total)
        yield latency
        in_flight = GaugeMetricFamily("llmgw_router_in_flight_requests", "Requests being proxied right now.")
        in_flight.add_metric([], self.in_flight)
        yield in_flight


class EjectionCollector(Collector):
    """Outlier ejection as the balancer counts it: ejections so far and replicas ejected now, per model."""

    def __init__(self, balancer: Balancer) -> None:
        self.balancer = balancer

    def collect(self) -> Iterator[Metric]:
        balancer = self.balancer
        ejections = CounterMetricFamily(
            "llmgw_router_ejections",
            "Replicas ejected after consecutive failures (or a failed probe), by model.",
            labels=["model"],
        )
        for model, count in sorted(balancer.ejection_counts().items()):
            ejections.add_metric([model], count)
        yield ejections
        now = dict.fromkeys(balancer.catalog(), 0)
        for endpoint in balancer.ejected():
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

    def __init__(self, balancer: Balancer) -> None:
        self.balancer = balancer

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
        for endpoint in sorted(self.balancer.endpoints(), key=lambda e: (e.model, e.replica_id)):
            labels = [endpoint.model, endpoint.replica_id]
            if endpoint.engine_waiting is not None:
                waiting.add_metric(labels, endpoint.engine_waiting)
            if endpoint.kv_usage is not None:
                kv_usage.add_metric(labels, endpoint.kv_usage)
        yield waiting
        yield kv_usage
