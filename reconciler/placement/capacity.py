"""The free-capacity snapshot the placer works on: free GPUs per node and class, ports in use per host.

A GPU is free when its node is ready and schedulable, and the GPU is healthy,
out of quarantine and held by no awake shard (DESIGN invariants 2 and 5):
sleepers stacked on it do not keep it from a new replica. Two queries whatever
the fleet size (three with ports found busy); placing a replica updates the snapshot in memory, so one tick
can place many replicas without reading again.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import Exists, OuterRef

from inventory.choices import NodeState
from inventory.models import GPU, Node, effective, gpu_in_service
from reconciler.models import BusyPort, GPUAssignment, Shard
from reconciler.placement.search import NodeCapacity, rendezvous_port


@dataclass
class NodeGPUs:
    """The GPUs of one class on one node: how many, and the free ones (index → GPU row id)."""

    node_id: int
    name: str
    fabric: str
    address: str
    gpu_class: str
    total: int = 0
    free: dict[int, int] = field(default_factory=dict)
    memory_mib: int = 0  # its smallest GPU of the class (a replica's shard may get any of them)
    out_of_service: int = 0  # unhealthy or in quarantine

    def record(self) -> NodeCapacity:
        """The placer's view of this node."""
        free = tuple(sorted(self.free))
        return NodeCapacity(
            self.name, self.fabric, self.address, self.gpu_class, free, self.total, self.memory_mib, self.out_of_service
        )


@dataclass
class CapacitySnapshot:
    """Free GPUs per class and node, with the placer's records kept in step, and ports in use per host."""

    nodes: dict[str, dict[str, NodeGPUs]] = field(default_factory=lambda: defaultdict(dict))
    ports: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    _records: dict[str, dict[str, NodeCapacity]] = field(default_factory=lambda: defaultdict(dict))
    _without_class: dict[str, str] = field(default_factory=dict)
    # Per class, free GPU count -> names of the nodes with that many free, sorted: `best_fit`'s index, built on
    # first use and kept in step by `take`.
    _by_free: dict[str, dict[int, list[str]]] = field(default_factory=dict)
    _memory_sizes: dict[str, frozenset[int]] = field(default_factory=dict)

    def index_records(self) -> None:
        """Make the placer's records of `nodes`, once they are filled in."""
        for gpu_class, nodes in self.nodes.items():
            self._records[gpu_class] = {name: node.record() for name, node in nodes.items()}
        self._by_free.clear()
        self._memory_sizes.clear()

    def records(self, gpu_class: str) -> list[NodeCapacity]:
        """Every node with GPUs of `gpu_class`, as the placer sees it now."""
        return list(self._records[gpu_class].values())

    def without_class(self, gpu_class: str) -> str:
        """Why no node the placer may use has GPUs of `gpu_class`, naming what is true of those that have some
        (read once per class and snapshot, only when a replica needs it)."""
        reason = self._without_class.get(gpu_class)
        if reason is None:
            reason = self._without_class[gpu_class] = no_usable_node(gpu_class)
        return reason

    def memory_sizes(self, gpu_class: str) -> frozenset[int]:
        """The GPU memory sizes (MiB) of the class's nodes (`fit.Records`)."""
        sizes = self._memory_sizes.get(gpu_class)
        if sizes is None:
            nodes = self.nodes.get(gpu_class, {})
            sizes = self._memory_sizes[gpu_class] = frozenset(n.memory_mib for n in nodes.values())
        return sizes

    def count(self, gpu_class: str) -> int:
        """How many nodes have GPUs of `gpu_class`."""
        return len(self._records[gpu_class])

    def best_fit(self, gpu_class: str, need: int, holders: Collection[str]) -> NodeCapacity | None:
        """The node `placement.place` chooses for one shard of `need` GPUs of `gpu_class` among every node of the
        class (weights holders first, then the fewest free that fit, then the name), or None when none fits.

        What `place` finds by a pass over the fleet, found from an index of the nodes by free count, so a tick
        placing thousands of replicas does not pass over thousands of nodes for each."""
        records = self._records[gpu_class]
        fitting = [node for node in map(records.get, holders) if node is not None and len(node.free) >= need]
        if fitting:
            return min(fitting, key=lambda node: (len(node.free), node.name))
        by_free = self._free_index(gpu_class)
        counts = [count for count, names in by_free.items() if count >= need and names]
        return records[by_free[min(counts)][0]] if counts else None

    def _free_index(self, gpu_class: str) -> dict[int, list[str]]:
        index = self._by_free.get(gpu_class)
        if index is None:
            index = self._by_free[gpu_class] = defaultdict(list)
            for name, node in sorted(self._records[gpu_class].items()):
                index[len(node.free)].append(name)  # in name order: each list is sorted
        return index

    def node(self, gpu_class: str, name: str) -> NodeGPUs:
        return self.nodes[gpu_class][name]

    def take(self, gpu_class: str, name: str, indices, port: int, span: int = 1) -> list[int]:
        """Hand GPUs `indices` and `span` ports from `port` of a node to a new shard; return the GPU row ids."""
        node = self.nodes[gpu_class][name]
        before = len(node.free)
        gpu_ids = [node.free.pop(index) for index in indices]
        # Only the touched node's record changes, so placing stays linear in replicas.
        self._records[gpu_class][name] = node.record()
        index = self._by_free.get(gpu_class)
        if index is not None:
            index[before].remove(name)
            bisect.insort(index[len(node.free)], name)
        self.ports[node.address].update(range(port, port + span))
        return gpu_ids


def free_capacity(now: datetime) -> CapacitySnapshot:
    """Read the snapshot. Ports are counted per host address, not per node: nodes sharing an
    address (simulated nodes on one box) share one port space."""
    snapshot = CapacitySnapshot()
    rows = (
        GPU.objects.filter(node__in=Node.objects.schedulable())
        .annotate(
            # Sleepers' assignments do not hold a GPU: only an awake shard does (DESIGN invariant 2).
            held=Exists(GPUAssignment.objects.filter(gpu=OuterRef("pk"), awake=True)),
            # The operator's fabric and address, else the agent's report (inventory.models.effective).
            node_fabric=effective("fabric", "node__"),
            node_address=effective("address", "node__"),
        )
        .values_list(
            "id",
            "index",
            "gpu_class",
            "memory_mb",
            "health",
            "healthy_since",
            "held",
            "node_id",
            "node__name",
            "node_fabric",
            "node_address",
        )
        .order_by("node_id", "index")
    )
    for gpu_id, index, gpu_class, memory, health, healthy_since, held, node_id, name, fabric, address in rows:
        node = snapshot.nodes[gpu_class].get(name)
        if node is None:
            node = snapshot.nodes[gpu_class][name] = NodeGPUs(
                node_id, name, fabric, address or name, gpu_class, memory_mib=memory
            )
        # memory_mb is MiB as nvidia-smi reports memory.total (agent/gpus/discovery.py); 0 = not reported.
        node.memory_mib = min(node.memory_mib, memory) if node.memory_mib and memory else node.memory_mib or memory
        node.total += 1
        if not gpu_in_service(health, healthy_since, now):
            node.out_of_service += 1
        elif not held:
            node.free[index] = gpu_id
    snapshot.index_records()
    shard_ports = Shard.objects.annotate(
        node_address=effective("address", "node__"),
        # The head of a replica spanning nodes holds its rendezvous port too (placement.rendezvous_port).
        spans=Exists(Shard.objects.filter(replica=OuterRef("replica"), rank=1)),
    )
    for address, name, port, rank, spans in shard_ports.values_list(
        "node_address", "node__name", "port", "rank", "spans"
    ):
        snapshot.ports[address or name].add(port)
        if rank == 0 and spans:
            snapshot.ports[address or name].add(rendezvous_port(port))
    busy_ports = BusyPort.objects.filter(until__gt=now).annotate(node_address=effective("address", "node__"))
    for address, name, port in busy_ports.values_list("node_address", "node__name", "port"):
        snapshot.ports[address or name].add(port)
    return snapshot


# How an unusable node's state reads in a reason, in the order reasons list them.
_STATE_WORDS: dict[str, str] = {
    NodeState.UNREACHABLE: "unreachable",
    NodeState.LOST: "lost",
    NodeState.NEW: "enrolled but never connected",
}
NAMED_NODES = 3  # nodes named per kind in a reason; the rest are counted


def no_usable_node(gpu_class: str) -> str:
    """Why no ready, schedulable node has GPUs of `gpu_class`: none has the class at all, or each node that has
    it is draining, cordoned, unreachable, lost or never connected (ctl_status, the dashboard and REST all show
    this text). One query."""
    draining = Shard.objects.filter(node=OuterRef("pk"), replica__drain_deadline__isnull=False)
    rows = (
        Node.objects.filter(gpus__gpu_class=gpu_class)
        .annotate(draining=Exists(draining))
        .order_by("name")
        .values_list("name", "state", "schedulable", "draining")
        .distinct()
    )
    kinds: dict[str, list[str]] = defaultdict(list)
    for name, state, schedulable, is_draining in rows:
        if state != NodeState.READY:
            kinds[_STATE_WORDS.get(state, state)].append(name)
        elif not schedulable:
            kinds["draining" if is_draining else "cordoned"].append(name)
    if not kinds:
        return f"no node has GPU class {gpu_class}"
    parts = []
    for word, names in kinds.items():
        more = f" and {len(names) - NAMED_NODES} more" if len(names) > NAMED_NODES else ""
        parts.append(f"{word}: {', '.join(names[:NAMED_NODES])}{more}")
    return f"every node with GPU class {gpu_class} is out of service ({'; '.join(parts)})"
