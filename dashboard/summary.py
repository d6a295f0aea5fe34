"""The one cluster summary every operator surface renders (DESIGN invariant 6).

`ctl_status`, the /admin dashboard, `/api/v1/status` and the fleet metrics all
call `cluster_summary()`, so none of them can disagree with another or with the
tables. It runs a fixed number of queries whatever the fleet size and returns
a `ClusterSummary` (`dashboard.summary_types`), whose `as_json()` is the JSON
form.

GPU states (DESIGN invariant 5, plus node availability), decided in this order:

* unavailable — its node is unreachable, never connected (new) or cordoned;
  health reported by such a node is stale or irrelevant, so the node decides;
* unhealthy — reported unhealthy, or healthy for less than the quarantine
  period (an unhealthy GPU that is also assigned is still unhealthy);
* used — held by a shard (has a GPUAssignment);
* free — the rest.

GPUs on lost nodes are not counted at all. `total = used + free + unhealthy +
unavailable` holds for every GPU class.

Failed replicas are grouped by the first line of their `last_error` (`failed`,
most frequent first); `unplaceable_models` are the models with a pending
replica that found no room and is not holding (`Replica.hold` empty: no room
being made, not waiting for nodes to report in) — the ones waiting on an
operator. `node_list` is every node with its GPUs by state
and the weights its agent reports on disk (`weights`: source, size_bytes, size).

A model's `adapters` count its enabled LoRA adapters, their loads loading and
loaded on its replicas (unloading ones have given their slot up) and the slots
of its ready replicas (their profiles' `max_adapters`); each replica counts
its own loads. Two queries at any number of adapters, both counted in SQL: a
count on the models' query, and the loads by replica and state.

`usage`, `idle_held_gpus` and `stoppable` ("what can I stop") come from
`dashboard.stoppable`, on the reconciler's own eviction rules.

`continuations` are the answers whose engine broke off over the last hour, per model: continued, ended with an
error, refused, and the prompt tokens re-read, from the hourly rows the tick stores (`keys.models.ContinuationHour`)
over the same window as the dashboard's usage chart (`dashboard.panels.usage_window_start`). One query, summed in SQL.

`felt` is what each model's users felt over the routers' last window (`dashboard.felt`): latency against
its objectives, its fair queues, each team's share of what went through them. One query.

`staging` is the weights being put on nodes before an engine needs them, and stages ended in the last hour
(`dashboard.stages`): bytes done of the total, rate and time left. One query.
"""

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db.models import Count, Q, Sum
from django.utils import timezone

from catalog.models import Model
from dashboard.felt import models_felt
from dashboard.panels import usage_window_start
from dashboard.stages import stages
from dashboard.stoppable import what_can_i_stop
from dashboard.summary_gpus import free_nodes, tally_gpus
from dashboard.summary_types import (
    AdapterCounts,
    AdapterLoading,
    ClusterSummary,
    Continuations,
    FailedReason,
    Leader,
    ModelContinuations,
    ModelStatus,
    NodeCounts,
    NodeStatus,
    NodeWeights,
    PartitionBrake,
    ReplicaCounts,
    ReplicaStatus,
    Unplaceable,
)
from inventory.models import Node, Weights, human_size, report_warnings
from keys.models import ContinuationHour
from reconciler.adapters import HELD
from reconciler.choices import WANTED_STATES, AdapterLoadState, Hold, ReplicaState
from reconciler.demand.idle import Idle
from reconciler.lifecycle.liveness import partition_brake
from reconciler.models import AdapterLoad, Lease, Replica, Shard

NO_ERROR = "(no error recorded)"


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _leader(now: datetime) -> Leader | None:
    lease = Lease.objects.filter(name=settings.LLMGW_LEASE_NAME).first()
    if lease is None:
        return None
    # expires_at is by the database's clock; the difference is for display only.
    return Leader(lease.owner, lease.epoch, round(lease.expires_at - now.timestamp(), 3))


def _weights_per_node() -> dict[int, list[NodeWeights]]:
    """The weights each node holds on disk, by source. One query."""
    weights: dict[int, list[NodeWeights]] = defaultdict(list)
    for node_id, source, size in Weights.objects.order_by("node_id", "source").values_list(
        "node_id", "source", "size_bytes"
    ):
        weights[node_id].append(NodeWeights(source, size, human_size(size)))
    return weights


def _nodes(gpus_per_node: dict[int, Counter]) -> tuple[NodeCounts, list[NodeStatus]]:
    """Node counts by state, and every node with its GPUs by state and its weights (no query per node)."""
    weights = _weights_per_node()
    counts: Counter = Counter()
    node_list = []
    rows = Node.objects.order_by("name").values_list(
        "id", "name", "state", "schedulable", "last_seen",
        "address", "fabric", "labels", "reported_address", "reported_fabric", "reported_labels",
    )  # fmt: skip
    for node_id, name, state, schedulable, last_seen, *fields in rows:
        address, fabric, labels, reported_address, reported_fabric, reported_labels = fields
        counts["total"] += 1
        counts[state] += 1
        if not schedulable:
            counts["cordoned"] += 1
        gpus = gpus_per_node.get(node_id, Counter())
        node_list.append(
            NodeStatus(
                name=name,
                fabric=fabric or reported_fabric,
                state=state,
                schedulable=schedulable,
                last_seen=_iso(last_seen),
                gpus=sum(gpus.values()),
                used=gpus["used"],
                free=gpus["free"],
                unhealthy=gpus["unhealthy"],
                unavailable=gpus["unavailable"],
                weights=weights.get(node_id, []),
                warnings=report_warnings(
                    {"address": address, "fabric": fabric, "labels": labels},
                    {"address": reported_address, "fabric": reported_fabric, "labels": reported_labels},
                ),
            )
        )
    return NodeCounts.of(counts), node_list


def first_line(text: str) -> str:
    """The first non-blank line of an error, stripped; failures are grouped by it."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return NO_ERROR


def _shards_by_replica() -> tuple[dict[int, list[str]], dict[int, int]]:
    nodes: dict[int, list[str]] = defaultdict(list)
    gpus: dict[int, int] = Counter()
    rows = (
        Shard.objects.annotate(gpu_count=Count("gpu_assignments"))
        .order_by("replica_id", "rank")
        .values_list("replica_id", "node__name", "gpu_count")
    )
    for replica_id, node_name, gpu_count in rows:
        nodes[replica_id].append(node_name)
        gpus[replica_id] += gpu_count
    return nodes, gpus


@dataclass
class _ReplicaTally:
    """The replica rows read once, counted every way the summary shows them."""

    counts: Counter = field(default_factory=Counter)
    wanted: Counter = field(default_factory=Counter)
    ready: Counter = field(default_factory=Counter)
    unplaceable: Counter = field(default_factory=Counter)  # (model, placement note, hold) -> pending replicas
    failed: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))  # reason -> model -> replicas
    # Models that found no room; one whose requests are held (room being made, nodes reporting in)
    # is not waiting on an operator.
    blocked: set[str] = field(default_factory=set)
    replicas: list[ReplicaStatus] = field(default_factory=list)
    adapter_loads: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))  # model -> state -> loads
    adapter_slots: Counter = field(default_factory=Counter)  # model -> max_adapters over its ready replicas

    def add(self, row: Mapping[str, Any], nodes: list[str], gpus: int, loads: Counter, now: datetime) -> None:
        state, model_name = row["state"], row["model__name"]
        self.counts[state] += 1
        if state in WANTED_STATES:
            self.wanted[model_name] += 1
        if state == ReplicaState.READY:
            self.ready[model_name] += 1
            self.adapter_slots[model_name] += row["profile__max_adapters"] or 0
        self.adapter_loads[model_name].update(loads)
        if state == ReplicaState.FAILED:
            self.failed[first_line(row["last_error"])][model_name] += 1
        if state == ReplicaState.PENDING and row["placement_note"]:
            self.unplaceable[(model_name, row["placement_note"], row["hold"])] += 1
            if row["hold"] == Hold.NONE:
                self.blocked.add(model_name)
        idle = Idle.since(row["last_used"], now)
        self.replicas.append(
            ReplicaStatus(
                row["id"],
                model_name,
                row["profile_id"],
                state,
                nodes,
                gpus,
                row["endpoint_url"],
                _iso(row["ready_at"]),
                _iso(row["last_used"]),
                idle.json_seconds(),
                idle.known,
                row["sleeping_level"],
                # A level-1 sleeper keeps its weights in host memory (reconciler.hibernate.host_memory).
                row["weights_bytes"] if row["sleeping_level"] == 1 else None,
                None if row["profile__wake_seconds"] is None else round(row["profile__wake_seconds"], 1),
                loads[AdapterLoadState.LOADED],
                loads[AdapterLoadState.LOADING],
            )
        )

    def adapters(self, model: str, registered: int) -> AdapterCounts:
        return AdapterCounts.of(
            {**self.adapter_loads[model], "registered": registered, "slots": self.adapter_slots[model]}
        )

    def replica_counts(self) -> ReplicaCounts:
        return ReplicaCounts.of({**self.counts, "total": len(self.replicas)})

    def unplaceable_list(self) -> list[Unplaceable]:
        return [
            Unplaceable(model, reason, count, hold) for (model, reason, hold), count in sorted(self.unplaceable.items())
        ]

    def failed_list(self) -> list[FailedReason]:
        """Most frequent reason first, so the line an operator needs is at the top."""
        ranked = sorted(self.failed.items(), key=lambda item: (-sum(item[1].values()), item[0]))
        return [FailedReason(reason, sum(models.values()), sorted(models)) for reason, models in ranked]


def _adapter_loads() -> dict[int, Counter]:
    """Replica id -> its adapter loads taking a slot, by state. One query, counted in SQL."""
    loads: dict[int, Counter] = defaultdict(Counter)
    # order_by() drops the model's ordering, which would split the groups by adapter.
    rows = AdapterLoad.objects.filter(state__in=HELD).values("replica_id", "state").annotate(n=Count("pk")).order_by()
    for row in rows:
        loads[row["replica_id"]][row["state"]] += row["n"]
    return loads


def _replicas(now: datetime) -> _ReplicaTally:
    """Every replica with its shards' nodes and GPUs and its adapter loads, tallied. Three queries."""
    shard_nodes, shard_gpus = _shards_by_replica()
    loads = _adapter_loads()
    tally = _ReplicaTally()
    rows = Replica.objects.order_by("id").values(
        "id", "model__name", "profile_id", "state", "endpoint_url", "ready_at", "last_used", "placement_note",
        "hold", "last_error", "sleeping_level", "weights_bytes", "profile__wake_seconds", "profile__max_adapters",
    )  # fmt: skip
    for row in rows:
        replica_id = row["id"]
        tally.add(row, shard_nodes.get(replica_id, []), shard_gpus.get(replica_id, 0), loads[replica_id], now)
    return tally


def _models(tally: _ReplicaTally) -> list[ModelStatus]:
    """Every catalog model with its replicas as tallied and its enabled adapters counted. One query."""
    registered = Count("adapters", filter=Q(adapters__enabled=True))
    return [
        ModelStatus(
            name,
            enabled,
            tally.wanted[name],
            tally.ready[name],
            tally.adapters(name, adapters),
            AdapterLoading(loads or 0, failures or 0, load_seconds),
        )  # fmt: skip
        for name, enabled, adapters, loads, failures, load_seconds in Model.objects.annotate(n=registered)
        .order_by("name")
        .values_list(
            "name", "enabled", "n", "adapter_stats__loads", "adapter_stats__failures", "adapter_stats__load_seconds"
        )
    ]


def _continuations(now: datetime) -> Continuations:
    """Broken answers per model over the last hour, the most broken first. One query, summed in SQL."""
    since = usage_window_start(now)
    rows = (
        ContinuationHour.objects.filter(hour__gte=since)
        .values("model")
        .annotate(c=Sum("continued"), f=Sum("failed"), r=Sum("refused"), t=Sum("reprocessed_prompt_tokens"))
        .order_by("model")
        .values_list("model", "c", "f", "r", "t")
    )
    models = [ModelContinuations(*row) for row in rows]
    models.sort(key=lambda m: -(m.continued + m.failed + m.refused))  # stable: by name within a count
    return Continuations(since.isoformat(), models)


def cluster_summary(now: datetime | None = None) -> ClusterSummary:
    """The state of the fleet; see the module docstring.

    Eleven queries whatever the fleet size: lease, GPUs, nodes, weights, models
    (with their adapters counted), replicas, shards (with their GPU counts),
    adapter loads (counted per replica and state), continuations (summed per model), what users felt
    (`dashboard.felt`), weights being staged (`dashboard.stages`) — and nothing per row; plus
    "what can I stop" (`stoppable.what_can_i_stop`, on the placer's records of
    the GPUs read here): one more when usage is unknown, at most seven more
    otherwise.
    """
    now = now or timezone.now()
    leader = _leader(now)
    gpus = tally_gpus(now)
    records, capacity = gpus.records(), gpus.capacity_list()
    nodes, node_list = _nodes(gpus.per_node)
    tally = _replicas(now)
    models = _models(tally)
    watched = nodes.ready + nodes.unreachable
    brake = PartitionBrake(
        partition_brake(nodes.unreachable, watched),
        nodes.unreachable,
        watched,
        settings.LLMGW_PARTITION_BRAKE_FRACTION,
    )
    stop = what_can_i_stop(
        now, leader=leader, gpu_classes=[row.gpu_class for row in capacity], unplaceable=tally.blocked, records=records
    )
    return ClusterSummary(
        generated_at=now.isoformat(),
        leader=leader,
        partition_brake=brake,
        capacity=capacity,
        free_nodes=free_nodes(records),
        nodes=nodes,
        replicas=tally.replica_counts(),
        models=models,
        unplaceable=tally.unplaceable_list(),
        unplaceable_models=sorted(tally.blocked),
        failed=tally.failed_list(),
        node_list=node_list,
        replica_list=tally.replicas,
        usage=stop.usage,
        idle_held_gpus=stop.idle_held_gpus,
        stoppable=stop.stoppable,
        continuations=_continuations(now),
        felt=models_felt(),
        staging=stages(now),
    )
