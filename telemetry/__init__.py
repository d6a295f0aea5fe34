"""Traces: OpenTelemetry spans for the router's request path and the reconcile tick, exported over OTLP when
the standard OTEL_* environment variables ask for them, and nothing at all when they do not.

Traces are on when OTEL_SDK_DISABLED is not "true" and OTEL_TRACES_EXPORTER names an exporter, or (the
exporter then being OTLP, the specification's default) OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set. The exporters shipped are `otlp` (OTLP over HTTP with protobuf,
which every collector takes) and `console`; the OTLP exporter reads its own variables (endpoint, headers,
timeout, compression). OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES name the process as usual; without a
service name, the router is `llmgw-router` and the control plane `llmgw-control-plane`. Sampling follows
OTEL_TRACES_SAMPLER, and a client's sampled `traceparent` is followed by default.

One provider per service and process, built on first use; `None` when traces are off, so a caller pays a
test of `None`, never a span, per request.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from threading import Lock
from typing import TYPE_CHECKING, ParamSpec, TypeVar

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

ROUTER = "llmgw-router"
CONTROL_PLANE = "llmgw-control-plane"
EXPORTERS = ("otlp", "console", "none")
# The OTLP exporter shipped speaks HTTP with protobuf; gRPC would need another package.
OTLP_PROTOCOLS = ("http/protobuf",)

P = ParamSpec("P")
R = TypeVar("R")

_providers: dict[str, TracerProvider | None] = {}
_lock = Lock()


class TracingConfigError(ValueError):
    """An OTEL_* variable llmgw cannot honour; the message names it."""


def exporter_name(environ: Mapping[str, str] = os.environ) -> str | None:
    """The exporter the environment asks for ("otlp" or "console"), None when it asks for no traces.

    Raises TracingConfigError naming the variable when a value is not one llmgw can honour."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown or len(names) > 1:
        raise TracingConfigError(
            f"OTEL_TRACES_EXPORTER={environ['OTEL_TRACES_EXPORTER']!r}: llmgw exports traces to one of "
            f"{', '.join(EXPORTERS)}"
        )
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    name = names[0] if names else ("otlp" if endpoint else "none")
    if name == "otlp":
        for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            protocol = environ.get(variable, "").strip()
            if protocol:
                if protocol not in OTLP_PROTOCOLS:
                    raise TracingConfigError(
                        f"{variable}={protocol!r}: llmgw exports OTLP over {', '.join(OTLP_PROTOCOLS)} only"
                    )
                break
    return None if name == "none" else name


def build_provider(
    service: str, environ: Mapping[str, str] = os.environ, exporter: SpanExporter | None = None
) -> TracerProvider | None:
    """A provider exporting `service`'s spans as the environment asks (or to `exporter`); None when traces are off."""
    # The SDK is imported only when traces are on: the settings import this package, so every process
    # (each `manage.py` command) would otherwise load it at start-up.
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if exporter is None:
        name = exporter_name(environ)
        if name is None:
            return None
        exporter = ConsoleSpanExporter() if name == "console" else _otlp_exporter()
    # OTEL_SERVICE_NAME, when set, wins (Resource.create reads it and OTEL_RESOURCE_ATTRIBUTES).
    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _otlp_exporter() -> SpanExporter:
    # Imported only when traces go over OTLP: it brings protobuf and requests with it.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def provider(service: str) -> TracerProvider | None:
    """This process's provider for `service` (ROUTER or CONTROL_PLANE), built from the environment once."""
    with _lock:
        if service not in _providers:
            _providers[service] = build_provider(service)
        return _providers[service]


def tracer(service: str, component: str) -> Tracer | None:
    """A tracer of this process's provider for `service`, named after `component`; None when traces are off."""
    found = provider(service)
    return None if found is None else found.get_tracer(component)


class Steps:
    """Runs the steps of one pass (a tick), each a span named after it when `tracer` is given: children of the
    span current at the time. Without a tracer a step is a plain call."""

    def __init__(self, tracer: Tracer | None):
        self.tracer = tracer

    def run(self, name: str, step: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """`step(*args, **kwargs)`, inside a span `name` when traces are on."""
        if self.tracer is None:
            return step(*args, **kwargs)
        with self.tracer.start_as_current_span(name):
            return step(*args, **kwargs)
