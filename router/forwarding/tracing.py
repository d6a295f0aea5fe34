"""Spans of a request's way through the router (telemetry/): the request, its hold for a replica, each pick and
the upstream exchange. The engine's own spans become children of the exchange's: the router sends it a W3C
`traceparent` naming that span, and a client's `traceparent` makes the request's span a child of the client's.

RouterState builds TracingHooks and a TracedPicker only when traces are on, so a router without them runs none
of this code (without them, a client's `traceparent` and `tracestate` still reach the engine unchanged:
router.forwarding.headers). The hooks wrap the steps the proxy hands them (ForwardingHooks); the picker's span
wraps its public `pick`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from router.endpoints.routes import RouteTable
from router.endpoints.table import Endpoint
from router.errors import RouterError
from router.forwarding.exchange import Forwarding
from router.picking.affinity import Prefix
from router.picking.picker import Picker

PROPAGATOR = TraceContextTextMapPropagator()
TRACE_HEADERS = (b"traceparent", b"tracestate")
MODEL = "llmgw.model"
REPLICA = "llmgw.replica"


class TracedPicker(Picker):
    """A Picker whose every pick is a span (a child of the request's, or of its hold's); give it its `tracer`."""

    tracer: Tracer | None = None

    def pick(
        self,
        model: str,
        exclude: Iterable[Endpoint] = (),
        affinity: Prefix | None = None,
        pools: frozenset[str] | None = None,
    ) -> Endpoint | None:
        if self.tracer is None:
            return super().pick(model, exclude, affinity, pools)
        with self.tracer.start_as_current_span("pick", attributes={MODEL: model}) as span:
            endpoint = super().pick(model, exclude, affinity, pools)
            if endpoint is not None:
                span.set_attribute(REPLICA, endpoint.replica_id)
            return endpoint


class TracingHooks:
    """The proxy's ForwardingHooks with traces: requests, holds and upstream exchanges are spans, and the engines
    hear of them."""

    def __init__(self, tracer: Tracer, routes: RouteTable) -> None:
        self.tracer = tracer
        self.routes = routes

    async def forward(self, request: Forwarding, step: Callable[[Forwarding], Awaitable[None]]) -> None:
        carrier = {n.decode("latin-1"): v.decode("latin-1") for n, v in request.scope["headers"] if n in TRACE_HEADERS}
        attributes = {"http.request.method": "POST", "url.path": request.path, MODEL: request.model}
        with self.tracer.start_as_current_span(
            f"POST {request.path}", PROPAGATOR.extract(carrier), SpanKind.SERVER, attributes
        ) as span:
            status = 0  # until known; an exception that is not an answer is recorded by the span itself
            try:
                await step(request)
                status = request.exchange.status or 0
            except RouterError as exc:
                status = exc.status
                raise
            finally:
                if status:
                    span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                if request.tried:
                    span.set_attribute(REPLICA, request.tried[-1].replica_id)

    async def hold(self, request: Forwarding, step: Callable[[Forwarding], Awaitable[Endpoint]]) -> Endpoint:
        with self.tracer.start_as_current_span("hold", attributes={MODEL: request.model}) as span:
            span.set_attribute("llmgw.hold.reason", self.routes.holding(request.model) or "cold_start")
            endpoint = await step(request)
            span.set_attribute(REPLICA, endpoint.replica_id)
            return endpoint

    async def send(
        self, request: Forwarding, endpoint: Endpoint, step: Callable[[Forwarding, Endpoint], Awaitable[None]]
    ) -> None:
        attributes = {MODEL: request.model, REPLICA: endpoint.replica_id, "server.address": endpoint.url}
        with self.tracer.start_as_current_span("upstream", kind=SpanKind.CLIENT, attributes=attributes) as span:
            try:
                await step(request, endpoint)
            finally:
                # A retry moves the exchange to another replica.
                span.set_attribute(REPLICA, request.tried[-1].replica_id)
                span.set_attribute("llmgw.attempts", len(request.tried))

    def upstream_headers(self, headers: dict[str, str]) -> None:
        PROPAGATOR.inject(headers)  # the upstream span, current here, is the engine's parent
