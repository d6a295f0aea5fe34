"""Traces through the router (router.forwarding.tracing): a client's trace context continues through the request, its
hold, its picks and the upstream exchange to the engine; with traces off, none of that code runs and the
client's trace context reaches the engine unchanged."""

import threading

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from conftest import wait_until
from router.forwarding.proxy import Proxy
from router.forwarding.tracing import TracedPicker, TracingHooks
from router.picking.picker import Picker
from router.tests.conftest import MODEL, FakeEngine, make_table
from router.tests.forwarding.test_proxy import CountingHub

pytestmark = pytest.mark.django_db(transaction=True)

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
TRACESTATE = "vendor=opaque"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


class HeaderRecordingEngine(FakeEngine):
    """A FakeEngine that keeps each request's headers."""

    def __init__(self, name: str = "engine"):
        super().__init__(name)
        self.headers: list[dict[str, str]] = []

    async def _begin(self, request) -> dict:
        self.headers.append(dict(request.headers))
        return await super()._begin(request)


@pytest.fixture
def engine():
    started = HeaderRecordingEngine().start()
    yield started
    started.stop()


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("router-tests"), exporter
    provider.shutdown()


def by_name(exporter) -> dict:
    return {span.name: span for span in exporter.get_finished_spans()}


def finished_request(exporter) -> dict:
    """The finished spans by name, once the request's own span (the last to end) is among them."""
    return wait_until(lambda: (found := by_name(exporter)).get("POST /v1/chat/completions") and found)


def test_a_clients_trace_goes_through_the_request_pick_and_upstream_to_the_engine(
    start_router, hub, auth, engine, spans
):
    tracer, exporter = spans
    hub.publish_endpoints(make_table([engine.url]))
    router = start_router(tracer=tracer)
    assert type(router.state.picker) is TracedPicker and type(router.state.proxy.hooks) is TracingHooks
    headers = {**auth, "traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    assert httpx.post(f"{router.url}/v1/chat/completions", headers=headers, json=BODY).status_code == 200
    found = finished_request(exporter)
    request, pick, upstream = found["POST /v1/chat/completions"], found["pick"], found["upstream"]
    # The request continues the client's trace; its pick and its exchange are its children.
    assert request.kind is SpanKind.SERVER
    assert f"{request.context.trace_id:032x}" == CLIENT_TRACE and f"{request.parent.span_id:016x}" == CLIENT_SPAN
    assert pick.parent.span_id == request.context.span_id == upstream.parent.span_id
    assert upstream.kind is SpanKind.CLIENT
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["llmgw.model"] == MODEL and upstream.attributes["llmgw.replica"] == "1"
    assert pick.attributes["llmgw.replica"] == "1" and upstream.attributes["server.address"] == engine.url
    # The engine's spans become children of the exchange's, in the client's trace, with its trace state.
    sent = engine.headers[-1]
    assert sent["traceparent"] == f"00-{CLIENT_TRACE}-{upstream.context.span_id:016x}-01"
    assert sent["tracestate"] == TRACESTATE


def test_a_request_held_for_a_cold_start_is_a_hold_span_with_its_picks_inside(start_router, hub, auth, engine, spans):
    tracer, exporter = spans
    counting = CountingHub(hub)
    hub.publish_endpoints(make_table())  # the model is known, nothing runs it
    router = start_router(counting, tracer=tracer, activation_timeout=5)

    def publish_when_asked():
        wait_until(lambda: counting.activations)
        hub.publish_endpoints(make_table([engine.url]))

    publisher = threading.Thread(target=publish_when_asked)
    publisher.start()
    assert httpx.post(f"{router.url}/v1/chat/completions", headers=auth, json=BODY).status_code == 200
    publisher.join()
    finished_request(exporter)
    finished = exporter.get_finished_spans()
    request = next(s for s in finished if s.name == "POST /v1/chat/completions")
    hold = next(s for s in finished if s.name == "hold")
    assert hold.parent.span_id == request.context.span_id
    assert hold.attributes["llmgw.hold.reason"] == "cold_start" and hold.attributes["llmgw.replica"] == "1"
    picks = [s for s in finished if s.name == "pick"]
    # The first pick found nothing (a child of the request); the one that found the replica is the hold's.
    assert picks[0].parent.span_id == request.context.span_id and "llmgw.replica" not in picks[0].attributes
    assert picks[-1].parent.span_id == hold.context.span_id and picks[-1].attributes["llmgw.replica"] == "1"


def test_an_answer_the_router_could_not_give_marks_the_request_span_as_an_error(start_router, hub, auth, spans):
    tracer, exporter = spans
    hub.publish_endpoints(make_table())
    router = start_router(tracer=tracer, activation_timeout=0)
    assert httpx.post(f"{router.url}/v1/chat/completions", headers=auth, json=BODY).status_code == 503
    request = finished_request(exporter)["POST /v1/chat/completions"]
    assert request.attributes["http.response.status_code"] == 503
    assert request.status.status_code is StatusCode.ERROR


def test_without_traces_no_tracing_code_runs_and_the_clients_context_reaches_the_engine(
    start_router, hub, auth, engine
):
    hub.publish_endpoints(make_table([engine.url]))
    router = start_router()  # the test environment asks for no traces
    state = router.state
    assert state.proxy.hooks is None and type(state.picker) is Picker and type(state.proxy) is Proxy
    headers = {**auth, "traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    assert httpx.post(f"{router.url}/v1/chat/completions", headers=headers, json=BODY).status_code == 200
    assert (engine.headers[-1]["traceparent"], engine.headers[-1]["tracestate"]) == (TRACEPARENT, TRACESTATE)


def test_the_traced_picker_overrides_only_what_the_picker_has():
    """A rename in Picker must not leave a traced method that nothing calls any more."""
    own = {name for name, value in vars(TracedPicker).items() if callable(value) and not name.startswith("__")}
    assert own == {"pick"}
    assert all(callable(getattr(Picker, name, None)) for name in own)
