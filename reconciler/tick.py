"""The reconcile tick: one bounded pass by the leader (DESIGN "Reconcile tick").

Read the hub → store token counts → budgets' soft limits → in one fenced transaction, the steps of `STEPS` in that order → commit →
send agent commands → tell the hub → publish endpoints if changed. A constant number of queries whatever the
fleet size: each step reads its tables once, decides in memory and writes in bulk; a step demand's census
finds nothing for is skipped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime

from django.utils import timezone
from opentelemetry.trace import Tracer

from hub import ControlPlaneHub, get_hub
from hub.contracts import Activation, UsageSnapshot
from keys.alerts import check_budget_alerts
from reconciler.adapters import assign_adapters, record_adapter_stamps, split_activations, tend_loads
from reconciler.choices import ReplicaState
from reconciler.commands import resend_unacknowledged
from reconciler.demand.gpu_time import count_gpu_time, counted, gpu_count_due
from reconciler.demand.scaling import DemandOutcome, apply_demand
from reconciler.demand.tokens import record_token_usage
from reconciler.demand.usage import UsageVerdict, assess_usage, collect_usage, mark_unused_since_ready
from reconciler.endpoints import build_endpoint_table
from reconciler.hibernate.swap import wake_for_demand
from reconciler.hibernate.tier import send_sleeps
from reconciler.leadership.lease import Leadership, LeaseLost, get_leadership
from reconciler.lifecycle.drain import drain_replaced
from reconciler.lifecycle.liveness import check_liveness, fail_slow_starts, fleet_settling
from reconciler.lifecycle.transitions import forgive_stable, retry_failed, stop_shards, stopping_or_sleeping
from reconciler.outbox import Outbox
from reconciler.placement.placer import PlacingOutcome, place_pending, resend_starts
from reconciler.weights.prefetch import tend_stages
from reconciler.weights.staging import stalls_due
from reconciler.weights.sweep import sweep_due, sweep_unused_weights, swept
from telemetry import CONTROL_PLANE, Steps
from telemetry import tracer as traces_tracer

log = logging.getLogger(__name__)

# The tick's steps in the order it runs them, each the name of its span (telemetry.Steps). This is the one list:
# docs/design.md's "Reconcile tick" follows it, and reconciler/tests/test_tick_traces.py holds both to it.
STEPS = (
    "read hub",
    "token usage",
    "budget alerts",
    # In the fenced transaction:
    "usage",
    "gpu time",
    "liveness",
    "slow starts",
    "adapter activations",
    "demand",
    "swaps",
    "retries",
    "forgive stable",
    "resend starts",
    "placement",
    "drain replaced",
    "adapter loads",
    "adapters",
    "stops",
    "sleeps",
    "weights sweep",
    "stages",
    "resend unacknowledged",
    # After commit:
    "tell hub",
)


@dataclass
class TickReport:
    """What one tick did. `leader` is False when this process did not hold the lease (and did nothing)."""

    leader: bool
    epoch: int = 0
    usage_updated: int = 0
    usage_forgotten: int = 0
    usage_idle_since_ready: int = 0
    usage_known: bool = False
    usage_unknown_reason: str = ""
    nodes_unreachable: int = 0
    nodes_lost: int = 0
    partition_brake: bool = False
    replicas_failed: int = 0
    replicas_created: int = 0
    replicas_stopped: int = 0
    replicas_idle_stopped: int = 0
    replicas_scaled_out: int = 0
    replicas_withdrawn: int = 0
    replicas_retried: int = 0
    replicas_placed: int = 0
    replicas_unplaceable: int = 0
    replicas_deleted: int = 0
    replicas_replaced: int = 0
    replicas_slept: int = 0
    replicas_woken: int = 0
    replicas_swapped_out: int = 0
    sleeps_sent: int = 0
    starts_sent: int = 0
    starts_resent: int = 0
    commands_resent: int = 0
    stops_sent: int = 0
    adapter_loads_sent: int = 0
    adapter_unloads_sent: int = 0
    weights_swept: bool = False
    gpu_time_counted: bool = False
    gpu_time_rows: int = 0
    weights_removals_sent: int = 0
    stages_asked: int = 0
    published: bool = False
    unknown_activations: list[str] = field(default_factory=list)


@dataclass
class _HubReadings:
    """What the tick read from the hub before its transaction; a failed read means "unknown", never a crash."""

    usage: UsageSnapshot | None  # None: collection failed, `usage_error` says why
    usage_error: str
    activations: set[Activation]


def tick(
    leadership: Leadership | None = None,
    hub: ControlPlaneHub | None = None,
    now: datetime | None = None,
    tracer: Tracer | None = None,
) -> TickReport:
    """One reconcile pass, leader only; see the module docstring. With traces on (telemetry/), the pass is a
    span `reconcile tick` and each step a child span of it (`tracer`: tests; else the environment's)."""
    leadership = leadership or get_leadership()
    if not leadership.renew():
        return TickReport(leader=False)
    tracer = tracer or traces_tracer(CONTROL_PLANE, "llmgw.reconciler")
    if tracer is None:
        return _tick(leadership, hub or get_hub(), now or timezone.now(), Steps(None))
    with tracer.start_as_current_span("reconcile tick", attributes={"llmgw.epoch": leadership.epoch}) as span:
        report = _tick(leadership, hub or get_hub(), now or timezone.now(), Steps(tracer))
        span.set_attribute("llmgw.leader", report.leader)
        return report


def _tick(leadership: Leadership, hub: ControlPlaneHub, now: datetime, steps: Steps) -> TickReport:
    report = TickReport(leader=True, epoch=leadership.epoch)
    readings = steps.run("read hub", _read_hub, hub)

    # Token counts the collection took from the hub: stored in their own transaction, before the fenced
    # one, so a tick that loses the lease loses none of them (reconciler.demand.tokens).
    steps.run("token usage", record_token_usage, readings.usage, hub)
    steps.run("budget alerts", check_budget_alerts, hub, now)

    try:
        # The fence is the transaction's last statement (DESIGN invariant 1): no lease lock while it works.
        with leadership.fenced_transaction():
            usage, forget = _reconcile(readings, leadership, now, report, steps)
    except LeaseLost as exc:
        log.warning("tick abandoned, nothing committed: %s", exc)
        leadership.held = False
        return TickReport(leader=False, epoch=report.epoch)
    if report.weights_swept:
        swept(leadership, now)
    if report.gpu_time_counted:
        counted(leadership, now)
    steps.run("tell hub", _tell_hub, hub, forget, usage.gone, report)
    return report


def _reconcile(
    readings: _HubReadings, leadership: Leadership, now: datetime, report: TickReport, steps: Steps
) -> tuple[UsageVerdict, list[str]]:
    """The steps inside the fenced transaction, in the order of `STEPS`, counted in `report`; returns the usage
    verdict and the usage stamps to forget once the transaction has committed."""
    outbox = Outbox(leadership.epoch, now)
    run = steps.run
    usage, forget = run("usage", _take_usage, readings, now, report)
    if gpu_count_due(leadership, now):  # before "stops" deletes replicas: their last seconds count
        report.gpu_time_rows = run("gpu time", count_gpu_time, now)
        report.gpu_time_counted = True
    liveness = run("liveness", check_liveness, now, leadership, outbox)
    report.nodes_unreachable, report.nodes_lost = liveness.unreachable, liveness.lost
    report.partition_brake = liveness.brake
    report.replicas_failed = liveness.replicas_failed + run(
        "slow starts", fail_slow_starts, now, outbox, liveness.stuck
    )
    # An adapter asked for starts or wakes its base like an activation; it is loaded once the base is ready.
    activations, wanted_adapters = run("adapter activations", split_activations, readings.activations)
    demand = run("demand", _apply_demand, activations, readings, usage, now, report)
    # Swaps before placement: a woken sleeper's GPUs are no longer free for a new replica this tick.
    report.replicas_woken, report.replicas_swapped_out = run("swaps", wake_for_demand, demand.wake, now, outbox)
    # A step finding no replica of its kind in demand's census is skipped: each is a query every tick.
    census = demand.census
    report.replicas_retried = run("retries", retry_failed, now) if ReplicaState.FAILED in census.states else 0
    if census.forgivable:
        run("forgive stable", forgive_stable, now)
    report.starts_resent = run("resend starts", resend_starts, now, outbox)
    placing = PlacingOutcome()
    # Pending replicas come from the census, demand's creations, retries and wakes: a step that makes them adds here.
    if ReplicaState.PENDING in census.states or demand.created or report.replicas_retried or demand.wake:
        paused, settling = _eviction_paused(usage, liveness.brake), lambda: fleet_settling(now, leadership)
        placing = run(
            "placement", place_pending, now, leadership.epoch, outbox, eviction_paused=paused, settling=settling
        )
    report.replicas_placed, report.replicas_unplaceable = placing.placed, placing.unplaceable
    if census.draining:
        # Node drains, make-before-break: after placement, which may have made a replacement ready to start.
        report.replicas_replaced = run("drain replaced", drain_replaced, now, placing.no_room)
    report.adapter_unloads_sent = run("adapter loads", tend_loads, now, outbox, usage_known=usage.known)
    in_flight = usage.in_flight if readings.usage is not None else None
    report.adapter_loads_sent = run("adapters", assign_adapters, wanted_adapters, now, outbox, in_flight)
    deleted = 0
    # Stopping and sleeping replicas: held before this tick (the census), or made by one of its steps.
    if census.states & {ReplicaState.STOPPING, ReplicaState.SLEEPING} or stopping_or_sleeping():
        report.stops_sent, deleted = run("stops", stop_shards, now, outbox)
        report.sleeps_sent = run("sleeps", send_sleeps, now, outbox)
    if sweep_due(leadership, now):
        report.weights_swept = True
        report.weights_removals_sent = run("weights sweep", sweep_unused_weights, now, outbox)
    report.stages_asked = run("stages", tend_stages, now, outbox) if stalls_due(leadership, now) else 0
    report.starts_sent = placing.starts_sent
    report.replicas_deleted = demand.deleted + deleted
    outbox.send_on_commit()
    # Last: this tick's commands have superseded the pending ones for the same shards by now,
    # so a start about to be drained is not sent again first.
    report.commands_resent = run("resend unacknowledged", resend_unacknowledged, now)
    return usage, forget


def _eviction_paused(usage: UsageVerdict, brake: bool) -> str:
    """Why nothing may be evicted this tick, or "" (DESIGN invariant 3; the partition brake)."""
    if brake:
        return "the partition brake is on"
    return "" if usage.known else f"idleness is unknown ({usage.reason})"


def _take_usage(readings: _HubReadings, now: datetime, report: TickReport) -> tuple[UsageVerdict, list[str]]:
    """Judge the usage snapshot and move its stamps into the replicas; (verdict, stamp keys to forget)."""
    usage = assess_usage(readings.usage, readings.usage_error, now)
    report.usage_known, report.usage_unknown_reason = usage.known, usage.reason
    # Stamps are facts whatever the verdict: move them even while idleness is unknown.
    stamps = readings.usage.stamps if readings.usage else {}
    report.usage_updated, forget = collect_usage(stamps)
    record_adapter_stamps(stamps)
    report.usage_forgotten = len(forget)
    if usage.known:
        report.usage_idle_since_ready = mark_unused_since_ready(usage.watching_since)
    return usage, forget


def _apply_demand(
    activations: set[Activation], readings: _HubReadings, usage: UsageVerdict, now: datetime, report: TickReport
) -> DemandOutcome:
    """Create, stop and scale replicas as demand says, counted in `report`."""
    # Idleness only while usage is known (DESIGN invariant 3); load only from a collection that worked.
    in_flight = usage.in_flight if readings.usage is not None else None
    demand = apply_demand(activations, now, usage_known=usage.known, in_flight=in_flight, windows=usage.windows)
    report.replicas_created, report.replicas_stopped = demand.created, demand.stopping
    report.replicas_idle_stopped, report.unknown_activations = demand.idle_stopped, demand.unknown_activations
    report.replicas_scaled_out, report.replicas_withdrawn = demand.scaled_out, demand.withdrawn
    report.replicas_slept = demand.slept
    return demand


def _tell_hub(hub: ControlPlaneHub, forget: list[str], gone: list[str], report: TickReport) -> None:
    """After commit: forget what was taken, publish the endpoint table. A hub that fails is retried next tick."""
    if forget:
        try:
            hub.forget_usage(forget)
        except Exception as exc:
            log.warning("could not forget usage stamps: %s", exc)
    if gone:
        try:
            hub.forget_routers(gone)
        except Exception as exc:  # they are listed again next tick
            log.warning("could not forget the marks of routers gone quiet: %s", exc)
    try:
        report.published = hub.publish_endpoints(build_endpoint_table())
    except Exception as exc:  # routers keep their last table and poll as a backstop
        log.warning("could not publish endpoints: %s", exc)


def _read_hub(hub: ControlPlaneHub) -> _HubReadings:
    usage: UsageSnapshot | None
    try:
        usage, usage_error = hub.collect_usage(), ""
    except Exception as exc:  # usage store down: idleness is unknown this tick (DESIGN invariant 3)
        log.warning("could not collect usage: %s", exc)
        usage, usage_error = None, str(exc) or type(exc).__name__
    try:
        activations = hub.drain_activations()
    except Exception as exc:
        log.warning("could not read activations: %s", exc)
        activations = set()
    return _HubReadings(usage, usage_error, activations)
