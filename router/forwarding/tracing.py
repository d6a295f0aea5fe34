"""Spans of a request's way through the router (telemetry/): the request, its hold for a replica, each pick and
the upstream exchange. The engine's own spans become children of the exchange's: the router sends it a W3C
`traceparent` naming that span, and a client's `traceparent` makes the request's span a child of the client's.

RouterState builds these classes instead of Balancer and Proxy only when traces are on, so a router without
them runs none of this code (without them, a client's `traceparent` and `tracestate` still reach the engine
unchanged: router.forwarding.headers).
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from router.config import RouterConfig
from router.endpoints.table import Endpoint
from router.errors import RouterError
from router.forwarding.coldstart import ColdStart
from router.forwarding.proxy import Forwarding, Proxy
from router.metrics import RouterMetrics
from router.picking.affinity import Prefix
from router.picking.balancer import Balancer

PROPAGATOR = TraceContextTextMapPropagator()
TRACE_HEADERS = (b"traceparent", b"tracestate")
MODEL = "llmgw.model"
REPLICA = "llmgw.replica"


class TracedBalancer(Balancer):
    """A Balancer whose every pick is a span (a child of the request's, or of its hold's); give it its `tracer`."""

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


class TracingProxy(Proxy):
    """A Proxy whose requests, holds and upstream exchanges are spans, and whose engines hear of them."""

    def __init__(
        self, balancer: Balancer, metrics: RouterMetrics, cold_start: ColdStart, config: RouterConfig, tracer: Tracer
    ):
        super().__init__(balancer, metrics, cold_start, config)
        self.tracer = tracer

    async def forward(self, request: Forwarding) -> None:
        carrier = {n.decode("latin-1"): v.decode("latin-1") for n, v in request.scope["headers"] if n in TRACE_HEADERS}
        attributes = {"http.request.method": "POST", "url.path": request.path, MODEL: request.model}
        with self.tracer.start_as_current_span(
            f"POST {request.path}", PROPAGATOR.extract(carrier), SpanKind.SERVER, attributes
        ) as span:
            status = 0  # until known; an exception that is not an answer is recorded by the span itself
            try:
                await super().forward(request)
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

    async def _wait_for_replica(self, request: Forwarding) -> Endpoint:
        with self.tracer.start_as_current_span("hold", attributes={MODEL: request.model}) as span:
            span.set_attribute("llmgw.hold.reason", self.balancer.holding(request.model) or "cold_start")
            endpoint = await super()._wait_for_replica(request)
            span.set_attribute(REPLICA, endpoint.replica_id)
            return endpoint

    async def _send_upstream(self, request: Forwarding, endpoint: Endpoint) -> None:
        attributes = {MODEL: request.model, REPLICA: endpoint.replica_id, "server.address": endpoint.url}
        with self.tracer.start_as_current_span("upstream", kind=SpanKind.CLIENT, attributes=attributes) as span:
            try:
                await super()._send_upstream(request, endpoint)
            finally:
                # A retry moves the exchange to another replica.
                span.set_attribute(REPLICA, request.tried[-1].replica_id)
                span.set_attribute("llmgw.attempts", len(request.tried))

    def _upstream_headers(self, request: Forwarding) -> dict[str, str]:
        headers = super()._upstream_headers(request)
        PROPAGATOR.inject(headers)  # the upstream span, current here, is the engine's parent
        return headers
