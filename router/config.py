"""The router's configuration: one frozen value, read from the settings once, handed to every part.

`RouterConfig.from_settings()` reads the LLMGW_* settings (already checked at
start-up, llmgw_site.settings); tests and benches pass overrides by name. The
router's parts (state, proxy, cold start, sweep, flusher) take it instead of a
dozen keyword arguments each. How the server runs it is
`router.serving.server_options`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from opentelemetry.trace import Tracer

from router.forwarding.coldstart import MIN_WAITERS
from router.picking.ejection import EjectionPolicy
from telemetry import ROUTER
from telemetry import tracer as traces_tracer


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How one router app behaves; `from_settings()` builds it from the LLMGW_* settings.

    `connect_timeout` bounds connecting to an engine, `first_byte_timeout` the
    wait for its answer to begin, `idle_timeout` the silence between chunks
    after that; nothing bounds a whole stream. `max_waiters` bounds the
    requests held per model while it starts, `keepalive_seconds` how often a
    stream held that way hears a keep-alive (0: it is not answered until a
    replica is ready). `stream_migrations`: how many times one stream whose
    engine broke off is continued on another replica (0: never). `ejection`
    says when failing replicas are ejected. `budget_reservation_seconds`: how long a budget's reservation
    outlives its router (longer than any answer); `budget_output_tokens`: the answer a budget reserves for when
    neither the request nor the table bounds it (router.accounting.budgets). `request_records`: whether it
    reports each request for the per-request log. `queue_max_waiting` and `queue_max_wait_seconds` bound each
    tenant's requests waiting for a full model, and their wait (router.forwarding.admission).
    `router_id` names this router's usage reports and watch mark (None: a new
    id per process, `router.accounting.flusher.new_router_id`). `tracer`: where its spans
    go when traces are on (telemetry/, from the OTEL_* environment), else None.
    """

    activation_timeout: float
    poll_seconds: float
    flush_seconds: float
    connect_timeout: float
    first_byte_timeout: float
    idle_timeout: float
    max_waiters: int
    kv_full_fraction: float
    affinity_slack: float
    metrics_token: str = ""
    retry_after: int = 10
    max_body_bytes: int = 64 * 1024 * 1024
    keepalive_seconds: float = 10.0
    stream_migrations: int = 2
    budget_reservation_seconds: float = 3600.0
    budget_output_tokens: int = 32_768
    request_records: bool = False
    queue_max_waiting: int = 1000
    queue_max_wait_seconds: float = 120.0
    latency_window_seconds: float = 60.0
    ejection: EjectionPolicy = field(default_factory=EjectionPolicy)
    router_id: str | None = None
    tracer: Tracer | None = None

    def __post_init__(self) -> None:
        if self.activation_timeout < 0:
            raise ValueError(f"activation_timeout must be >= 0, not {self.activation_timeout!r}")
        for name in (
            "poll_seconds",
            "flush_seconds",
            "connect_timeout",
            "first_byte_timeout",
            "idle_timeout",
            "latency_window_seconds",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, not {getattr(self, name)!r}")
        if self.max_waiters < MIN_WAITERS:
            raise ValueError(f"max_waiters must be >= {MIN_WAITERS}, not {self.max_waiters!r}")
        if self.retry_after < 0 or self.max_body_bytes < 0 or self.keepalive_seconds < 0 or self.stream_migrations < 0:
            raise ValueError("retry_after, max_body_bytes, keepalive_seconds and stream_migrations must be >= 0")
        if self.router_id is not None and not self.router_id:
            raise ValueError("router_id must be a non-empty string (or None for a new one per process)")

    @classmethod
    def from_settings(cls, **overrides: Any) -> RouterConfig:
        """The configuration the settings give, with `overrides` (field names) in place of theirs."""
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"RouterConfig has no field {', '.join(sorted(unknown))}")
        return cls(
            **{
                "activation_timeout": float(settings.LLMGW_ACTIVATION_TIMEOUT_SECONDS),
                "poll_seconds": float(settings.LLMGW_ROUTER_POLL_SECONDS),
                "flush_seconds": float(settings.LLMGW_USAGE_FLUSH_SECONDS),
                "connect_timeout": float(settings.LLMGW_UPSTREAM_CONNECT_SECONDS),
                "first_byte_timeout": float(settings.LLMGW_UPSTREAM_FIRST_BYTE_SECONDS),
                "idle_timeout": float(settings.LLMGW_UPSTREAM_IDLE_SECONDS),
                "max_waiters": int(settings.LLMGW_MAX_WAITERS_PER_MODEL),
                "stream_migrations": int(settings.LLMGW_STREAM_MIGRATIONS),
                "budget_reservation_seconds": float(settings.LLMGW_BUDGET_RESERVATION_SECONDS),
                "budget_output_tokens": int(settings.LLMGW_BUDGET_OUTPUT_TOKENS),
                "request_records": int(settings.LLMGW_REQUEST_RECORD_DAYS) > 0,
                "queue_max_waiting": int(settings.LLMGW_QUEUE_MAX_WAITING),
                "queue_max_wait_seconds": float(settings.LLMGW_QUEUE_MAX_WAIT_SECONDS),
                "latency_window_seconds": float(settings.LLMGW_LATENCY_WINDOW_SECONDS),
                "kv_full_fraction": float(settings.LLMGW_KV_CACHE_FULL_FRACTION),
                "affinity_slack": float(settings.LLMGW_PREFIX_AFFINITY_SLACK),
                "metrics_token": settings.LLMGW_METRICS_TOKEN or "",
                "tracer": None if "tracer" in overrides else traces_tracer(ROUTER, "llmgw.router"),
                **overrides,
            }
        )
