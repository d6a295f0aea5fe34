"""When traces are on, where they go, and a clear error for OTEL_* values llmgw cannot honour; spans really
leave over OTLP/HTTP to a collector on 127.0.0.1."""

import asyncio
import threading

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from conftest import free_port
from telemetry import CONTROL_PLANE, ROUTER, Steps, TracingConfigError, build_provider, exporter_name

ENDPOINT = "http://127.0.0.1:4318"


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, "otlp"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{ENDPOINT}/v1/traces"}, "otlp"),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, "otlp"),  # the exporter's own default endpoint
        ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, None),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "otlp"),
        # The traces' own protocol wins over the general one.
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
             "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "otlp",
        ),
    ],
)  # fmt: skip
def test_traces_are_on_when_the_standard_variables_ask_for_them(environ, expected):
    assert exporter_name(environ) == expected


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER='jaeger'"),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, "OTEL_TRACES_EXPORTER='otlp,console'"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
         "OTEL_EXPORTER_OTLP_PROTOCOL='grpc'"),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
         "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'"),
    ],
)  # fmt: skip
def test_a_value_llmgw_cannot_honour_is_an_error_naming_the_variable(environ, named):
    with pytest.raises(TracingConfigError, match=named.replace("(", r"\(")):
        exporter_name(environ)


def test_no_provider_is_built_when_traces_are_off():
    assert build_provider(ROUTER, {}) is None


def test_steps_are_plain_calls_without_a_tracer():
    assert Steps(None).run("add", lambda a, b=0: a + b, 2, b=3) == 5


@pytest.fixture
def collector():
    """An OTLP/HTTP trace collector on 127.0.0.1 (aiohttp on a thread): the export requests it received."""
    received: list[ExportTraceServiceRequest] = []
    content_types: list[str] = []

    async def traces(request):
        content_types.append(request.content_type)
        received.append(ExportTraceServiceRequest.FromString(await request.read()))
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="collector")
    thread.start()
    yield f"http://127.0.0.1:{port}", received, content_types
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.mark.parametrize(("service_name", "expected"), [(None, CONTROL_PLANE), ("cp-eu-1", "cp-eu-1")])
def test_spans_are_exported_over_otlp_http_named_after_the_service(collector, monkeypatch, service_name, expected):
    url, received, content_types = collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
    if service_name:
        monkeypatch.setenv("OTEL_SERVICE_NAME", service_name)
    else:
        monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    provider = build_provider(CONTROL_PLANE)
    assert provider is not None
    Steps(provider.get_tracer("tests")).run("one step", lambda: None)
    assert provider.force_flush(10_000)
    provider.shutdown()
    assert content_types == ["application/x-protobuf"]
    (resource_spans,) = received[0].resource_spans
    attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert attributes["service.name"] == expected
    assert [s.name for s in resource_spans.scope_spans[0].spans] == ["one step"]
