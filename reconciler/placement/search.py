"""Where a replica fits: pure functions over plain data, no ORM.

The caller passes free capacity per (node, GPU class) — only healthy,
out-of-quarantine, unassigned GPUs on ready, schedulable nodes count as free —
and a profile's shape, and the nodes already holding the profile's weights on
disk. `place` answers with a Placement (rank 0 first) or an
Unplaceable whose reason is written in aggregate words for operators.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class NodeCapacity:
    """Free GPUs of one class on one node, and how many GPUs of that class the node has."""

    name: str
    fabric: str
    address: str
    gpu_class: str
    free: tuple[int, ...]
    total: int
    memory_mib: int = 0  # the smallest GPU of the class on the node, as its agent reports it; 0 = unknown
    out_of_service: int = 0  # GPUs of the class unhealthy or in quarantine (neither used nor free)

    def __post_init__(self) -> None:
        if len(set(self.free)) != len(self.free):
            raise ValueError(f"node {self.name}: free GPU indices repeat: {sorted(self.free)}")
        if len(self.free) > self.total:
            raise ValueError(
                f"node {self.name}: {len(self.free)} free {self.gpu_class} GPUs but only {self.total} in all"
            )

    @property
    def whole(self) -> bool:
        """Every GPU of the class on the node is free (a multi-node replica needs whole nodes)."""
        return self.total > 0 and len(self.free) == self.total


class ProfileShape(Protocol):
    """What a shape is read from: a catalog profile, or a row holding its three columns by name."""

    @property
    def gpu_class(self) -> str: ...
    @property
    def gpus_per_node(self) -> int: ...
    @property
    def nodes_per_replica(self) -> int: ...


@dataclass(frozen=True)
class Shape:
    """What one replica of a profile needs."""

    gpu_class: str
    gpus_per_node: int
    nodes_per_replica: int = 1

    def __post_init__(self) -> None:
        if not self.gpu_class:
            raise ValueError("shape needs a GPU class")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be at least 1, got {self.gpus_per_node}")
        if self.nodes_per_replica < 1:
            raise ValueError(f"nodes_per_replica must be at least 1, got {self.nodes_per_replica}")

    @classmethod
    def of(cls, profile: ProfileShape) -> Shape:
        """The shape of one replica of `profile`."""
        return cls(profile.gpu_class, profile.gpus_per_node, profile.nodes_per_replica)


@dataclass(frozen=True)
class ShardPlacement:
    """The GPUs one shard gets on one node."""

    node: str
    address: str
    gpu_indices: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """A replica's shards, rank 0 (the head) first."""

    shards: tuple[ShardPlacement, ...]


@dataclass(frozen=True)
class Unplaceable:
    """No room for the replica; `reason` says why in aggregate terms."""

    reason: str


def place(
    capacity: Iterable[NodeCapacity], shape: Shape, holding: Collection[str] = frozenset()
) -> Placement | Unplaceable:
    """Choose GPUs for one replica of `shape` from `capacity`.

    Weights first, best fit second: a node in `holding` (it has the weights on
    disk, so the engine starts without a download) wins over any node without
    them, however much better that one fits.

    Single node: among the fitting nodes (holders first), best fit: the fewest
    free GPUs of the class (ties by name), taking its lowest free indices.
    Multi-node: N whole free nodes on one non-empty fabric (DESIGN invariant 5),
    choosing the fabric where the most of the N nodes hold the weights, then
    the one with the fewest whole free nodes that still fits (ties by fabric
    name); its nodes are taken holders first, then by name.
    """
    candidates = [c for c in capacity if c.gpu_class == shape.gpu_class]
    if not candidates:
        return Unplaceable(f"no node has GPU class {shape.gpu_class}")
    holders = frozenset(holding)
    if shape.nodes_per_replica == 1:
        return _place_single(candidates, shape, holders)
    return _place_multi(candidates, shape, holders)


def _place_single(candidates: list[NodeCapacity], shape: Shape, holders: frozenset[str]) -> Placement | Unplaceable:
    need = shape.gpus_per_node
    fitting = [c for c in candidates if len(c.free) >= need]
    if not fitting:
        most = min(candidates, key=lambda c: (-len(c.free), c.name))
        where = f"{len(most.free)} ({most.name})" if most.free else "0"
        return Unplaceable(
            f"needs {need}×{shape.gpu_class} on one node; most free on one node: {where}{_out_of_service(candidates)}"
        )
    return on_node(min(fitting, key=lambda c: (c.name not in holders, len(c.free), c.name)), need)


def on_node(node: NodeCapacity, need: int) -> Placement:
    """A single-node placement on `node`: its `need` lowest free GPUs."""
    return Placement((ShardPlacement(node.name, node.address, tuple(sorted(node.free)[:need])),))


def _place_multi(candidates: list[NodeCapacity], shape: Shape, holders: frozenset[str]) -> Placement | Unplaceable:
    need_nodes, need = shape.nodes_per_replica, shape.gpus_per_node
    by_fabric: dict[str, list[NodeCapacity]] = defaultdict(list)
    unfabricated = 0
    for c in candidates:
        if c.whole and len(c.free) >= need:
            if c.fabric:
                by_fabric[c.fabric].append(c)
            else:
                unfabricated += 1  # never combined: nothing says it can talk to another node fast
    fitting = [f for f, nodes in by_fabric.items() if len(nodes) >= need_nodes]
    if not fitting:
        free = [f"{len(nodes)} on {fabric}" for fabric, nodes in sorted(by_fabric.items())]
        if unfabricated:
            free.append(f"{unfabricated} without a fabric")
        return Unplaceable(
            f"needs {need_nodes} whole {shape.gpu_class} nodes on one fabric; free: {', '.join(free) or 'none'}"
            f"{_out_of_service(candidates)}"
        )

    def holding_in(fabric: str) -> int:
        return min(need_nodes, sum(c.name in holders for c in by_fabric[fabric]))

    fabric = min(fitting, key=lambda f: (-holding_in(f), len(by_fabric[f]), f))
    nodes = sorted(by_fabric[fabric], key=lambda c: (c.name not in holders, c.name))[:need_nodes]
    return Placement(tuple(ShardPlacement(c.name, c.address, tuple(sorted(c.free)[:need])) for c in nodes))


def pick_port(used_ports: set[int], port_range: tuple[int, int], span: int = 1) -> int | None:
    """The lowest port of the inclusive `port_range` that begins `span` consecutive ports none of which is in
    `used_ports`, or None when there is none."""
    low, high = port_range
    if not (0 < low <= high < 65536):
        raise ValueError(f"port range {low}-{high} is not a valid range of TCP ports")
    for port in range(low, high - span + 2):
        if not any(p in used_ports for p in range(port, port + span)):
            return port
    return None


def rendezvous_port(head_port: int) -> int:
    """Where the ranks of a replica spanning nodes meet on its head node: the port after the head's engine port.

    The placer gives a multi-node replica's head two consecutive ports (`pick_port(..., span=2)`) and
    counts both as used, so no other engine is given the second one.
    """
    return head_port + 1


def _out_of_service(candidates: list[NodeCapacity]) -> str:
    """What an unplaceable reason adds when GPUs of the class are out of service: where (the first few)."""
    sick = sorted((c.name, c.out_of_service) for c in candidates if c.out_of_service)
    if not sick:
        return ""
    named = ", ".join(f"{count} on {name}" for name, count in sick[:3])
    more = f" and {len(sick) - 3} more nodes" if len(sick) > 3 else ""
    return f"; unhealthy or in quarantine: {named}{more}"
