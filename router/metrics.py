"""Prometheus metrics of one router app, in a registry of its own.

A registry per app (not the process-wide default) lets the embedded `up`
command and tests run several routers in one process without clashes.
Labels only ever carry published model names, never what a client typed, so
a client cannot blow up the label cardinality.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

UNKNOWN_MODEL = "-"


class RouterMetrics:
    """The router's counters, histogram and gauges."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "llmgw_router_requests",
            "Requests answered, by public model name and HTTP status code.",
            ["model", "code"],
            registry=self.registry,
        )
        self.upstream_latency = Histogram(
            "llmgw_router_upstream_latency_seconds",
            "Time from sending a request to an engine to its response headers.",
            ["model"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.in_flight = Gauge(
            "llmgw_router_in_flight_requests", "Requests being proxied right now.", registry=self.registry
        )
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
