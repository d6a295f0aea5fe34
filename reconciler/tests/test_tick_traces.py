"""The tick as a trace (telemetry/): one `reconcile tick` span per pass, each step a child span of it."""

import ast
import re
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from hub import get_hub
from reconciler import tick as tick_module
from reconciler.models import Replica
from reconciler.tick import STEPS, tick
from tests.fleet import make_model, make_node

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
# Skipped when demand's census finds no replica of their kind (failed, counting failures, waiting for a
# replacement, stopping or sleeping): a first tick over an empty fleet has none. The weights sweep runs every
# LLMGW_WEIGHTS_SWEEP_SECONDS, not on a leader's first tick; stages are tended every quarter of
# LLMGW_STAGE_STALL_SECONDS, not on a leader's first tick either.
SKIPPED = {
    "retries", "forgive stable", "drain replaced", "stops", "sleeps", "weights sweep", "gpu time", "stages"
}  # fmt: skip


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
    children = sorted(
        (s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id),
        key=lambda s: s.start_time,
    )
    assert [s.name for s in children] == [step for step in STEPS if step not in SKIPPED]
    provider.shutdown()


def test_the_tick_runs_its_steps_in_the_order_of_its_list():
    # Every step the tick's code runs, skipped or not, in the order its code runs them (the fenced
    # transaction's steps where `_tick` calls `_reconcile`): STEPS is the one list of them.
    functions = {
        node.name: node
        for node in ast.parse(Path(tick_module.__file__).read_text()).body
        if isinstance(node, ast.FunctionDef)
    }

    def steps_of(function: ast.FunctionDef) -> list[str]:
        calls = sorted(
            (node for node in ast.walk(function) if isinstance(node, ast.Call)), key=lambda n: (n.lineno, n.col_offset)
        )
        named = []
        for call in calls:
            callee = getattr(call.func, "id", getattr(call.func, "attr", None))
            if callee == "run" and call.args and isinstance(call.args[0], ast.Constant):
                named.append(call.args[0].value)
            elif callee == "_reconcile":
                named += steps_of(functions["_reconcile"])
        return named

    assert steps_of(functions["_tick"]) == list(STEPS)


def test_the_design_lists_the_ticks_steps_in_its_order():
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("## Reconcile tick", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"\*\*`([^`]+)`\*\*", section) == list(STEPS)
