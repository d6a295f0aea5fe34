"""The GPU side of the cluster summary (dashboard.summary): every GPU not on a lost node read in one query,
tallied by class and state, per node, and as the placer's records of each ready, schedulable node."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import Exists, OuterRef

from dashboard.summary_types import GPU_STATES, Capacity, FreeNodes
from inventory.choices import NodeState
from inventory.models import GPU, effective, gpu_in_service
from reconciler.models import GPUAssignment
from reconciler.placement.search import NodeCapacity


def gpu_state(gpu, now: datetime) -> str:
    """The display state of one GPU row (a named row of `_gpu_rows`): unavailable, unhealthy, used or free."""
    if gpu.node__state != NodeState.READY or not gpu.node__schedulable:
        return "unavailable"
    if not gpu_in_service(gpu.health, gpu.healthy_since, now):
        return "unhealthy"
    if gpu.assigned:
        return "used"
    return "free"


def _gpu_rows():
    # Used means an awake shard holds it; sleepers stacked on a GPU leave it free (DESIGN invariant 2).
    held = GPUAssignment.objects.filter(gpu=OuterRef("pk"), awake=True)
    # Named rows, not dicts: a big fleet has tens of thousands of GPUs, and a dict per row is most of their cost.
    return (
        GPU.objects.exclude(node__state=NodeState.LOST)
        .annotate(assigned=Exists(held), node_fabric=effective("fabric", "node__"))
        .values_list(
            "node_id", "node__name", "node_fabric", "node__state", "node__schedulable",
            "index", "gpu_class", "health", "healthy_since", "assigned",
            named=True,
        )
    )  # fmt: skip


@dataclass
class GPUTally:
    """The GPU rows read once, counted every way the summary shows them."""

    capacity: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))  # class -> state -> GPUs
    per_node: dict[int, Counter] = field(default_factory=lambda: defaultdict(Counter))  # node id -> state -> GPUs
    # (node id, class) -> what the placer would see of it, for ready, schedulable nodes
    placeable: dict[tuple[int, str], dict] = field(default_factory=dict)

    def add(self, gpu, now: datetime) -> None:
        state = gpu_state(gpu, now)
        self.capacity[gpu.gpu_class][state] += 1
        self.per_node[gpu.node_id][state] += 1
        if gpu.node__state == NodeState.READY and gpu.node__schedulable:
            entry = self.placeable.setdefault(
                (gpu.node_id, gpu.gpu_class),
                {"name": gpu.node__name, "fabric": gpu.node_fabric, "free": [], "total": 0},
            )
            entry["total"] += 1
            if state == "free":
                entry["free"].append(gpu.index)

    def capacity_list(self) -> list[Capacity]:
        return [
            Capacity(gpu_class, sum(counts.values()), *(counts[state] for state in GPU_STATES))
            for gpu_class, counts in sorted(self.capacity.items())
        ]

    def records(self) -> dict[str, list[NodeCapacity]]:
        """Per GPU class, the placer's record of each ready, schedulable node: free GPUs by the placer's own rule
        (`reconciler.placement.capacity.free_capacity` reads the same), so status and placement agree."""
        records: dict[str, list[NodeCapacity]] = defaultdict(list)
        for (_node_id, gpu_class), entry in self.placeable.items():
            free = tuple(sorted(entry["free"]))
            records[gpu_class].append(NodeCapacity(entry["name"], entry["fabric"], "", gpu_class, free, entry["total"]))
        return records


def free_nodes(records: dict[str, list[NodeCapacity]]) -> list[FreeNodes]:
    """Per (fabric, GPU class), the ready, schedulable nodes whose GPUs are all free."""
    # Every (fabric, class) with a ready, schedulable node is listed, even at 0,
    # so a metric series drops to zero instead of vanishing. "Whole" is the
    # placer's own rule (NodeCapacity.whole), so status and placement agree.
    groups: dict[tuple[str, str], list[str]] = {}
    for gpu_class, nodes in records.items():
        for node in nodes:
            names = groups.setdefault((node.fabric, gpu_class), [])
            if node.whole:
                names.append(node.name)
    return [
        FreeNodes(fabric, gpu_class, len(names), sorted(names)) for (fabric, gpu_class), names in sorted(groups.items())
    ]


def tally_gpus(now: datetime) -> GPUTally:
    """Every GPU not on a lost node, tallied. One query."""
    tally = GPUTally()
    for gpu in _gpu_rows():
        tally.add(gpu, now)
    return tally
