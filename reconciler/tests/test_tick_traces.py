"""The tick as a trace (telemetry/): one `reconcile tick` span per pass, each step a child span of it."""

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from hub import get_hub
from reconciler.models import Replica
from reconciler.tick import tick
from tests.fleet import make_model, make_node

pytestmark = pytest.mark.django_db

STEPS = {
    "read hub", "token usage", "usage", "liveness", "slow starts", "adapter activations", "demand", "swaps",
    "retries", "forgive stable", "resend starts", "placement", "drain replaced", "adapter loads", "adapters",
    "stops", "sleeps", "resend unacknowledged", "tell hub",
}  # fmt: skip
# Skipped when demand's census finds no replica of their kind (failed, counting failures, waiting for a
# replacement, stopping or sleeping): a first tick over an empty fleet has none.
SKIPPED = {"retries", "forgive stable", "drain replaced", "stops", "sleeps"}


def test_a_tick_is_a_span_with_a_child_span_per_step(leader, django_capture_on_commit_callbacks):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    make_node("node-a", gpus=2)
    make_model("traced", min_replicas=1)
    with django_capture_on_commit_callbacks(execute=True):
        report = tick(leadership=leader, hub=get_hub(), tracer=provider.get_tracer("tests"))
    assert report.replicas_placed == 1 and Replica.objects.count() == 1
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.parent is None]
    assert root.name == "reconcile tick"
    assert root.attributes["llmgw.leader"] is True and root.attributes["llmgw.epoch"] == leader.epoch
    children = {s.name for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id}
    assert children == STEPS - SKIPPED
    provider.shutdown()
