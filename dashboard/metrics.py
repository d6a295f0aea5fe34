"""Fleet gauges for Prometheus, computed from `cluster_summary()` at scrape time (DESIGN invariant 6),
the tokens spent per model and API key (`llmgw_tokens_total`) from the stored TokenUsage rows, and each team's
spend and budgets from `team_summary()` (labelled by team only: teams are few and made by operators, where users
and keys are many).

Importing this module registers the collector once on prometheus_client's
default REGISTRY, which django-prometheus serves at /metrics; llmgw_site.urls
imports it.
"""

import hmac
import logging
from collections import defaultdict

from django.conf import settings
from django.db import DatabaseError
from django.db.models import Sum
from django.http import HttpRequest, HttpResponse
from django_prometheus.exports import ExportToDjangoView
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dashboard.summary import cluster_summary
from dashboard.summary_types import GPU_STATES, ClusterSummary, ReplicaStatus
from dashboard.team_summary import TeamSummary, team_summary
from hub import get_hub
from keys.models import SPEND_UNITS, TokenUsage

log = logging.getLogger(__name__)


def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    return {
        "gpus": GaugeMetricFamily("llmgw_gpus", "GPUs by class and state.", labels=["gpu_class", "state"]),
        "free": GaugeMetricFamily(
            "llmgw_whole_free_nodes",
            "Ready, schedulable nodes whose GPUs of the class are all free.",
            labels=["fabric", "gpu_class"],
        ),
        "replicas": GaugeMetricFamily("llmgw_replicas", "Replicas by state.", labels=["state"]),
        "models": GaugeMetricFamily(
            "llmgw_model_replicas", "Replicas per model: wanted or ready.", labels=["model", "kind"]
        ),
        "nodes": GaugeMetricFamily(
            "llmgw_nodes", "Nodes by state; `cordoned` overlaps the other states.", labels=["state"]
        ),
        "brake": GaugeMetricFamily(
            "llmgw_partition_brake", "1 while so many nodes are silent that none is declared lost."
        ),
        "idle_held": GaugeMetricFamily(
            "llmgw_idle_held_gpus",
            "GPUs held by replicas known idle for over an hour (0 for every class while usage is unknown).",
            labels=["gpu_class"],
        ),
        "usage_known": GaugeMetricFamily(
            "llmgw_usage_known", "1 while the fleet's usage is known; 0 pauses idle stops and evictions."
        ),
        "unplaceable": GaugeMetricFamily(
            "llmgw_unplaceable_models",
            "Models with a replica that found no room and is waiting on an operator (victims not already draining).",
        ),
        "lease_epoch": GaugeMetricFamily(
            "llmgw_lease_epoch", "Epoch of the leader lease; a rise is a change of leader (absent: no lease yet)."
        ),
        "lease_holder": GaugeMetricFamily(
            "llmgw_lease_holder", "1 for the control plane holding the leader lease.", labels=["owner"]
        ),
        "lease_expires": GaugeMetricFamily(
            "llmgw_lease_expires_in_seconds", "Seconds until the leader lease lapses; negative once it has."
        ),
        "sleeping_gpus": GaugeMetricFamily(
            "llmgw_sleeping_gpus",
            "GPUs sleeping replicas keep their engines on (another may be awake there).",
            labels=["model"],
        ),
        "sleeping_host_memory": GaugeMetricFamily(
            "llmgw_sleeping_host_memory_bytes", "Host memory level-1 sleepers hold (their weights).", labels=["model"]
        ),
        "wake_seconds": GaugeMetricFamily(
            "llmgw_model_wake_seconds",
            "How long a sleeping model's replicas take to wake, as learned (absent until one wake is timed).",
            labels=["model"],
        ),
        **_adapter_families(),
        **_team_families(),
        **_felt_families(),
        **_staging_families(),
        "up": GaugeMetricFamily("llmgw_summary_up", "1 if the cluster summary could be read at this scrape."),
    }


def _adapter_families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    return {
        "adapter_loads": CounterMetricFamily(
            "llmgw_adapter_loads", "LoRA adapter loads the agents answered, per base model.", labels=["model"]
        ),
        "adapter_load_failures": CounterMetricFamily(
            "llmgw_adapter_load_failures", "LoRA adapter loads that failed, per base model.", labels=["model"]
        ),
        "adapter_load_seconds": GaugeMetricFamily(
            "llmgw_adapter_load_seconds",
            "How long a LoRA adapter load takes on a base model's replicas, as learned (absent until one is timed).",
            labels=["model"],
        ),
        "adapters": GaugeMetricFamily(
            "llmgw_adapters",
            "LoRA adapters per base model: registered (enabled), loaded or loading (loads on its replicas).",
            labels=["model", "state"],
        ),
        "adapter_slots": GaugeMetricFamily(
            "llmgw_adapter_slots", "LoRA adapter slots of a base model's ready replicas.", labels=["model"]
        ),
        "replica_adapters": GaugeMetricFamily(
            "llmgw_replica_adapters",
            "LoRA adapters loaded on a replica, for every replica of a base model with adapters.",
            labels=["replica", "model"],
        ),
    }


def _felt_families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    return {
        "felt_p90": GaugeMetricFamily(
            "llmgw_model_latency_p90_seconds",
            "p90 over the routers' last window (LLMGW_LATENCY_WINDOW_SECONDS) of streamed answers' time to first "
            "token (`ttft`, queue wait included) and gaps between tokens (`itl`), per model.",
            labels=["model", "latency"],
        ),
        "felt_objective": GaugeMetricFamily(
            "llmgw_model_latency_objective_seconds",
            "The model's first profile's p90 objective for time to first token (`ttft`) or gaps between tokens.",
            labels=["model", "latency"],
        ),
        "felt_attained": GaugeMetricFamily(
            "llmgw_model_objective_attainment_ratio",
            "Share of first tokens (`ttft`) or gaps (`itl`) within the objective over the routers' last window.",
            labels=["model", "latency"],
        ),
        "felt_pressure": GaugeMetricFamily(
            "llmgw_model_objective_pressure",
            "The worst p90 over its objective, replicas still starting discounted: scale-out acts at "
            "LLMGW_OBJECTIVE_SCALE_UP.",
            labels=["model"],
        ),
        "queue_waiting": GaugeMetricFamily(
            "llmgw_model_queue_waiting",
            "Requests waiting in the routers' fair queues for a full model, summed over the routers, by class.",
            labels=["model", "class"],
        ),
        "queue_wait_p90": GaugeMetricFamily(
            "llmgw_model_queue_wait_p90_seconds",
            "p90 wait of the requests that left a model's fair queues over the routers' last window, by class.",
            labels=["model", "class"],
        ),
        "team_share": GaugeMetricFamily(
            "llmgw_model_team_token_share",
            "Each team's share of the tokens a model served through its fair queues over the routers' last window "
            "(`served`) and the share its weight asks for (`weighted`).",
            labels=["model", "team", "share"],
        ),
    }


def _staging_families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    return {
        "staging_bytes": GaugeMetricFamily(
            "llmgw_weights_staging_bytes",
            "Weights being staged on a node before an engine needs them: bytes on disk (`done`) and in all (`total`, "
            "once the hub has said). Only stages under way have series.",
            labels=["node", "source", "bytes"],
        ),
        "staging_rate": GaugeMetricFamily(
            "llmgw_weights_staging_bytes_per_second",
            "The rate a stage under way fetches at, as its agent last reported.",
            labels=["node", "source"],
        ),
        "staging_left": GaugeMetricFamily(
            "llmgw_weights_staging_seconds_left",
            "What a stage under way has left to fetch at its current rate (absent while there is no rate).",
            labels=["node", "source"],
        ),
    }


def _staging(summary: ClusterSummary, families: dict[str, GaugeMetricFamily | CounterMetricFamily]) -> None:
    """Stages under way (ClusterSummary.staging); ended ones have no series, so the labels stay bounded."""
    for stage in summary.staging:
        if stage.state not in ("asked", "fetching"):
            continue
        families["staging_bytes"].add_metric([stage.node, stage.source, "done"], stage.bytes_done)
        if stage.bytes_total:
            families["staging_bytes"].add_metric([stage.node, stage.source, "total"], stage.bytes_total)
        families["staging_rate"].add_metric([stage.node, stage.source], stage.bytes_per_second)
        if stage.seconds_left is not None:
            families["staging_left"].add_metric([stage.node, stage.source], stage.seconds_left)


def _felt(summary: ClusterSummary, families: dict[str, GaugeMetricFamily | CounterMetricFamily]) -> None:
    """What users felt per model (ClusterSummary.felt): a series only for the figures the window had."""
    for m in summary.felt:
        for latency, p90, objective, attained in (
            ("ttft", m.ttft_p90_seconds, m.ttft_objective_seconds, m.ttft_attained),
            ("itl", m.itl_p90_seconds, m.itl_objective_seconds, m.itl_attained),
        ):
            for family, value in (("felt_p90", p90), ("felt_objective", objective), ("felt_attained", attained)):
                if value is not None:
                    families[family].add_metric([m.model, latency], value)
        if m.pressure is not None:
            families["felt_pressure"].add_metric([m.model], m.pressure)
        for queue in m.queue:
            families["queue_waiting"].add_metric([m.model, queue.name], queue.waiting)
            if queue.wait_p90_seconds is not None:
                families["queue_wait_p90"].add_metric([m.model, queue.name], queue.wait_p90_seconds)
        for share in m.shares:
            families["team_share"].add_metric([m.model, share.team, "served"], share.share)
            families["team_share"].add_metric([m.model, share.team, "weighted"], share.weighted_share)


def _team_families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    return {
        "team_spend": GaugeMetricFamily(
            "llmgw_team_spend",
            "What a team's keys were charged in the current UTC day or month, in the currency of the prices.",
            labels=["team", "window"],
        ),
        "team_gpu_hours": GaugeMetricFamily(
            "llmgw_team_gpu_hours",
            "A team's showback this UTC month: GPU-hours of the replicas it used, by its share of their tokens "
            '(team "": keys of no team; "(idle)": replicas\' hours that served no tokens).',
            labels=["team"],
        ),
        "team_budget_used": GaugeMetricFamily(
            "llmgw_team_budget_used_ratio",
            "A team's own budget: spent and reserved in its current window over its amount (1 or more: exhausted).",
            labels=["team", "window"],
        ),
        "team_budgets_exhausted": GaugeMetricFamily(
            "llmgw_team_budgets_exhausted",
            "Budgets bearing on a team (its own, its members', its keys') that hold their whole amount now.",
            labels=["team"],
        ),
        "team_budgets_known": GaugeMetricFamily(
            "llmgw_team_budgets_known", "1 if the budgets' counters could be read at this scrape (else no ratios)."
        ),
    }


def _teams(teams: TeamSummary, families: dict[str, GaugeMetricFamily | CounterMetricFamily]) -> None:
    """Spend per team and UTC window; its budgets' use only when their counters were read (unknown is not 0)."""
    for team in teams.teams:
        families["team_spend"].add_metric([team.name, "day"], team.spend_today_units / SPEND_UNITS)
        families["team_spend"].add_metric([team.name, "month"], team.spend_month_units / SPEND_UNITS)
        for budget in team.budgets:
            if budget.used_ratio is not None:
                families["team_budget_used"].add_metric([team.name, budget.window], budget.used_ratio)
        if team.budgets_exhausted is not None:
            families["team_budgets_exhausted"].add_metric([team.name], team.budgets_exhausted)
        families["team_gpu_hours"].add_metric([team.name], team.gpu_seconds_month / 3600)
    families["team_gpu_hours"].add_metric(["(no team)"], teams.gpu_seconds_month_no_team / 3600)
    families["team_gpu_hours"].add_metric(["(idle)"], teams.gpu_seconds_month_idle / 3600)
    families["team_budgets_known"].add_metric([], 1 if teams.budgets_known else 0)


def _tokens_family() -> CounterMetricFamily:
    return CounterMetricFamily(
        "llmgw_tokens",
        "Tokens the routers counted in engines' answers, by model, API key name and kind (prompt or completion).",
        labels=["model", "key", "kind"],
    )


def tokens_family() -> CounterMetricFamily:
    """llmgw_tokens_total from the stored rows: one query, grouped by model and key name."""
    family = _tokens_family()
    rows = (
        TokenUsage.objects.order_by()
        .values_list("model", "key_name")
        .annotate(prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"))
        .order_by("model", "key_name")
    )
    for model, key_name, prompt, completion in rows:
        family.add_metric([model, key_name, "prompt"], prompt or 0)
        family.add_metric([model, key_name, "completion"], completion or 0)
    return family


class FleetCollector(Collector):
    """Yields the fleet gauges from one cluster summary per scrape, and the teams' from one team summary."""

    def describe(self):
        # Without describe(), registering would call collect() and query the database at import.
        return [*_families().values(), _tokens_family()]

    def collect(self):
        families = _families()
        try:
            summary = cluster_summary()
            tokens = tokens_family()
            teams = team_summary(get_hub())
        except DatabaseError:
            # A scrape must not fail the process metrics with it; report the gap instead.
            log.exception("cluster summary unavailable for /metrics")
            families["up"].add_metric([], 0)
            yield families["up"]
            return
        for row in summary.capacity:
            for state in GPU_STATES:
                families["gpus"].add_metric([row.gpu_class, state], getattr(row, state))
        for free in summary.free_nodes:
            families["free"].add_metric([free.fabric, free.gpu_class], free.whole_free_nodes)
        for state, count in summary.replicas.items():
            if state != "total":
                families["replicas"].add_metric([state], count)
        for model in summary.models:
            families["models"].add_metric([model.name, "wanted"], model.wanted)
            families["models"].add_metric([model.name, "ready"], model.ready)
        for state, count in summary.nodes.items():
            if state != "total":
                families["nodes"].add_metric([state], count)
        families["brake"].add_metric([], 1 if summary.partition_brake.engaged else 0)
        for held in summary.idle_held_gpus.by_class:
            families["idle_held"].add_metric([held.gpu_class], held.gpus)
        families["usage_known"].add_metric([], 1 if summary.usage.known else 0)
        families["unplaceable"].add_metric([], len(summary.unplaceable_models))
        leader = summary.leader
        if leader is not None:
            families["lease_epoch"].add_metric([], leader.epoch)
            families["lease_holder"].add_metric([leader.owner], 1)
            families["lease_expires"].add_metric([], leader.expires_in_seconds)
        _sleepers(summary.replica_list, families)
        _adapters(summary, families)
        _teams(teams, families)
        _felt(summary, families)
        _staging(summary, families)
        families["up"].add_metric([], 1)
        yield from families.values()
        yield tokens


def _sleepers(replicas: list[ReplicaStatus], families: dict[str, GaugeMetricFamily | CounterMetricFamily]) -> None:
    """The hibernate tier per model: GPUs its sleepers are stacked on, host memory they hold, its wake time."""
    gpus: dict[str, int] = defaultdict(int)
    memory: dict[str, int] = defaultdict(int)
    wake: dict[str, float] = {}
    for replica in replicas:
        if replica.state != "sleeping":
            continue
        gpus[replica.model] += replica.gpus
        memory[replica.model] += replica.host_memory_bytes or 0
        if replica.wake_seconds is not None:
            wake[replica.model] = max(wake.get(replica.model, 0.0), replica.wake_seconds)
    for model in sorted(gpus):
        families["sleeping_gpus"].add_metric([model], gpus[model])
        families["sleeping_host_memory"].add_metric([model], memory[model])
        if model in wake:
            families["wake_seconds"].add_metric([model], wake[model])


def _adapters(summary: ClusterSummary, families: dict[str, GaugeMetricFamily | CounterMetricFamily]) -> None:
    """LoRA adapters per base model that has any, and per replica of those (a series per adapter would be
    thousands)."""
    bases = {model.name for model in summary.models if model.adapters.shown}
    for model in summary.models:
        if model.name in bases:
            for state, count in model.adapters.items():
                if state != "slots":
                    families["adapters"].add_metric([model.name, state], count)
            families["adapter_slots"].add_metric([model.name], model.adapters.slots)
            loading = model.adapter_loading
            families["adapter_loads"].add_metric([model.name], loading.loads)
            families["adapter_load_failures"].add_metric([model.name], loading.failures)
            if loading.load_seconds is not None:
                families["adapter_load_seconds"].add_metric([model.name], loading.load_seconds)
    for replica in summary.replica_list:
        if replica.model in bases:
            families["replica_adapters"].add_metric([str(replica.id), replica.model], replica.adapters_loaded)


def metrics_view(request: HttpRequest) -> HttpResponse:
    """/metrics, behind `Authorization: Bearer <LLMGW_METRICS_TOKEN>` when that is set (401 otherwise)."""
    token = settings.LLMGW_METRICS_TOKEN
    if token:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        # Constant-time compare: the answer's timing must not tell how much of a guess was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            response = HttpResponse(
                "/metrics needs 'Authorization: Bearer <token>' (LLMGW_METRICS_TOKEN).\n",
                status=401,
                content_type="text/plain",
            )
            response["WWW-Authenticate"] = "Bearer"
            return response
    return ExportToDjangoView(request)


_collector: FleetCollector | None = None


def register() -> FleetCollector:
    """Register the collector on the default registry, once per process."""
    global _collector
    if _collector is None:
        _collector = FleetCollector()
        REGISTRY.register(_collector)
    return _collector


register()
