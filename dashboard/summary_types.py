"""The cluster summary as a typed value, defined once (DESIGN invariant 6: one summary for every surface).

`dashboard.summary.cluster_summary()` builds a `ClusterSummary`; ctl_status,
the dashboard views and templates and the fleet metrics read it by
attribute; `ClusterSummary.as_json()` is what `ctl_status --json` prints and
`/api/v1/status` answers, and the OpenAPI schema of that answer is derived
from these classes (`dashboard.api.status`), so none of them describes the
shape a second time.

Timestamps are ISO 8601 strings (the JSON form); a field's metadata gives
its schema where the Python type alone would say less (a date-time, the
meaning of -1). Unknown idleness stays one value type, `reconciler.demand.idle.Idle`:
a replica's `idle` is read back from its JSON form, never recomputed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Self

from reconciler.demand.idle import Idle


class _DateTime(Mapping[str, Any]):
    """Field metadata for the schema: this ISO 8601 string is a date-time there (`serializer_field`, a DRF field).

    The field is made when the schema is, not at import: DRF's serializers are
    a tenth of a second of start-up that `ctl_status` and the metrics never use.
    """

    def __init__(self, *, allow_null: bool = False):
        self.allow_null = allow_null

    def __getitem__(self, key: str) -> Any:
        if key != "serializer_field":
            raise KeyError(key)
        from rest_framework import serializers

        return serializers.DateTimeField(allow_null=self.allow_null)

    def __iter__(self) -> Iterator[str]:
        return iter(("serializer_field",))

    def __len__(self) -> int:
        return 1


_TIME = _DateTime()
_NULLABLE_TIME = _DateTime(allow_null=True)
_IDLE_SECONDS = {"serializer_kwargs": {"help_text": "-1 when unknown (see idle_known)."}}


class _Counts:
    """Counts a table or metric lists one column per field, in field order."""

    @classmethod
    def of(cls, counts: Mapping[str, int]) -> Self:
        """From counts by name (a name not counted is 0)."""
        return cls(**{f.name: counts.get(f.name, 0) for f in fields(cls)})  # type: ignore[arg-type]

    def items(self) -> list[tuple[str, int]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self)]  # type: ignore[arg-type]


@dataclass(frozen=True)
class Leader:
    """The leader lease as status shows it; `expires_in_seconds` is negative once it has lapsed."""

    owner: str
    epoch: int
    expires_in_seconds: float


@dataclass(frozen=True)
class PartitionBrake:
    """Whether so many nodes went silent at once that none is declared lost."""

    engaged: bool
    silent_nodes: int
    watched_nodes: int
    fraction: float


@dataclass(frozen=True)
class Capacity:
    """GPUs of one class by state; `total = used + free + unhealthy + unavailable`."""

    gpu_class: str
    total: int
    used: int
    free: int
    unhealthy: int
    unavailable: int


GPU_STATES = ("used", "free", "unhealthy", "unavailable")
"""The GPU states, in the order tables and metrics list them (fields of `Capacity` and `NodeStatus`)."""


@dataclass(frozen=True)
class FreeNodes:
    """Ready, schedulable nodes of one (fabric, class) whose GPUs of the class are all free."""

    fabric: str
    gpu_class: str
    whole_free_nodes: int
    nodes: list[str]


@dataclass(frozen=True)
class NodeCounts(_Counts):
    """Nodes by state; `cordoned` overlaps the other states."""

    total: int
    ready: int
    unreachable: int
    lost: int
    new: int
    cordoned: int


@dataclass(frozen=True)
class ReplicaCounts(_Counts):
    """Replicas by state (one field per `ReplicaState`, a test keeps them in step), then the total."""

    pending: int
    starting: int
    ready: int
    sleeping: int
    waking: int
    stopping: int
    failed: int
    total: int


@dataclass(frozen=True)
class AdapterCounts(_Counts):
    """A base model's LoRA adapters: enabled ones registered, loads loaded and loading on its replicas
    (an adapter on two replicas counts twice, as it takes two slots), and the slots of its ready replicas."""

    registered: int
    loaded: int
    loading: int
    slots: int

    @property
    def shown(self) -> bool:
        """Whether surfaces list it: adapters registered, or loads left from a disabled one."""
        return bool(self.registered or self.loaded or self.loading)


@dataclass(frozen=True)
class AdapterLoading:
    """A base model's LoRA adapter loads as the agents answered them (counters), and how long one takes
    (learned; None until a load was timed)."""

    loads: int
    failures: int
    load_seconds: float | None


@dataclass(frozen=True)
class ModelStatus:
    """A catalog model with its wanted and ready replicas and its LoRA adapters."""

    name: str
    enabled: bool
    wanted: int
    ready: int
    adapters: AdapterCounts
    adapter_loading: AdapterLoading


@dataclass(frozen=True)
class Unplaceable:
    """Pending replicas of a model that found no room, per reason. `holding` says why routers still hold its
    requests (`making_room`, `waiting_for_nodes`): then it is held, waiting on the fleet, not unplaceable
    until an operator acts (empty)."""

    model: str
    reason: str
    pending: int
    holding: str

    @property
    def held(self) -> bool:
        return bool(self.holding)


@dataclass(frozen=True)
class FailedReason:
    """Failed replicas grouped by the first line of their last error."""

    reason: str
    replicas: int
    models: list[str]


@dataclass(frozen=True)
class NodeWeights:
    """Weights a node's agent reports on disk."""

    source: str
    size_bytes: int
    size: str


@dataclass(frozen=True)
class NodeStatus:
    """One node with its GPUs by state, the weights on its disk and where its report disagrees."""

    name: str
    fabric: str
    state: str
    schedulable: bool
    last_seen: str | None = field(metadata=_NULLABLE_TIME)
    gpus: int
    used: int
    free: int
    unhealthy: int
    unavailable: int
    weights: list[NodeWeights]
    warnings: list[str]


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica: where it runs, its endpoint and how long it has been idle (known or not)."""

    id: int
    model: str
    profile_id: int
    state: str
    nodes: list[str]
    gpus: int
    endpoint: str
    ready_at: str | None = field(metadata=_NULLABLE_TIME)
    last_used: str | None = field(metadata=_NULLABLE_TIME)
    idle_seconds: float = field(metadata=_IDLE_SECONDS)
    idle_known: bool
    sleeping_level: int | None
    """The level it sleeps at (the hibernate tier); None when it does not sleep."""
    host_memory_bytes: int | None
    """Host memory its sleep holds (its weights, at level 1); None when none."""
    wake_seconds: float | None
    """How long its profile's replicas take to wake, as learned; None while unknown."""
    adapters_loaded: int
    """LoRA adapters loaded on it."""
    adapters_loading: int
    """LoRA adapters being loaded on it (the load sent, not yet answered)."""

    @property
    def idle(self) -> Idle:
        return Idle.from_json(self.idle_seconds, self.idle_known)


@dataclass(frozen=True)
class UsageState:
    """Whether the fleet's usage is known, since when, and if not, why (then nothing counts as idle)."""

    known: bool
    since: str | None = field(metadata=_NULLABLE_TIME)
    reason: str


@dataclass(frozen=True)
class IdleHeldClass:
    """GPUs of one class held by replicas known idle for over an hour."""

    gpu_class: str
    gpus: int


@dataclass(frozen=True)
class IdleHeld:
    """GPUs held by replicas known idle for over an hour, in total and per class (every class, 0 included)."""

    total: int
    by_class: list[IdleHeldClass]


@dataclass(frozen=True)
class StopCandidate:
    """A replica an operator may stop, what stopping it frees and which unplaceable models would then fit."""

    replica: int
    model: str
    gpu_class: str
    gpus: int
    nodes: list[str]
    idle_seconds: float
    idle: str
    frees: str
    unblocks: list[str]


@dataclass(frozen=True)
class ModelContinuations:
    """One model's answers whose engine broke off, by what became of them (keys.models.ContinuationHour)."""

    model: str
    continued: int
    """The client had its whole answer: continued on another replica, asked again whole, or lacking only its end."""
    failed: int
    """Ended with an error: no other replica, or LLMGW_STREAM_MIGRATIONS reached."""
    refused: int
    """Ended with an error: going on would change the answer (n > 1, guided, logprobs, a tool call…)."""
    reprocessed_prompt_tokens: int
    """Prompt tokens engines read again to continue them."""


@dataclass(frozen=True)
class Continuations:
    """Answers whose engine broke off over the last hour, per model with any (most broken first), as the routers
    counted them: whole hours, from the start of the previous one (`since`) on."""

    since: str = field(metadata=_TIME)
    models: list[ModelContinuations]


@dataclass(frozen=True)
class QueueClass:
    """One priority class of a model's fair queues, summed over the routers."""

    name: str
    waiting: int
    """Requests waiting now."""
    wait_p90_seconds: float | None
    """p90 of the waits of requests that left the queue over the window (None: none left it)."""


@dataclass(frozen=True)
class TeamShare:
    """One team's share of the tokens a model served through its fair queues over the window, against its weight."""

    team: str
    tokens: int
    share: float
    """Its tokens over every team's."""
    weight: int
    weighted_share: float
    """Its weight over the weights of the teams served: the share fairness aims at when all of them want more."""


@dataclass(frozen=True)
class ModelFelt:
    """What a model's users felt over the routers' last window (LLMGW_LATENCY_WINDOW_SECONDS), as the tick last
    recorded it (reconciler.demand.objectives): p90 time to first token and gap between tokens against the primary
    profile's objectives, the share of each within its objective, the pressure objective scaling acts on, its fair
    queues per class, and each team's share of what went through them."""

    model: str
    ttft_p90_seconds: float | None
    ttft_objective_seconds: float | None
    ttft_attained: float | None
    itl_p90_seconds: float | None
    itl_objective_seconds: float | None
    itl_attained: float | None
    pressure: float | None
    """The worst p90 over its objective, replicas still starting discounted; scale-out at LLMGW_OBJECTIVE_SCALE_UP."""
    parked: int
    """Ready replicas parked out of rotation, which its objectives no longer need: the idle timeout stops them."""
    queue: list[QueueClass]
    shares: list[TeamShare]

    @property
    def waiting(self) -> int:
        return sum(q.waiting for q in self.queue)


@dataclass(frozen=True)
class StageStatus:
    """One source's weights being staged on one node (inventory.WeightsStage), as its agent last reported."""

    node: str
    source: str
    state: str
    """asked (stage_weights sent, no report yet), fetching, ready or failed."""
    bytes_done: int
    bytes_total: int
    """0 while not known (the agent has not heard from the hub yet)."""
    bytes_per_second: float
    seconds_left: float | None
    """At the current rate; None while there is no rate."""
    message: str
    updated_at: str = field(metadata=_TIME)

    @property
    def fraction(self) -> float | None:
        return self.bytes_done / self.bytes_total if self.bytes_total else None


@dataclass(frozen=True)
class ClusterSummary:
    """The state of the fleet: the same data as `ctl_status`, the dashboard, `/api/v1/status` and the metrics."""

    generated_at: str = field(metadata=_TIME)
    leader: Leader | None
    partition_brake: PartitionBrake
    capacity: list[Capacity]
    free_nodes: list[FreeNodes]
    nodes: NodeCounts
    replicas: ReplicaCounts
    models: list[ModelStatus]
    unplaceable: list[Unplaceable]
    unplaceable_models: list[str]
    failed: list[FailedReason]
    node_list: list[NodeStatus]
    replica_list: list[ReplicaStatus]
    usage: UsageState
    idle_held_gpus: IdleHeld
    stoppable: list[StopCandidate]
    continuations: Continuations
    felt: list[ModelFelt]
    """Models whose users' figures the routers reported over the last window: the most pressed first."""
    staging: list[StageStatus]
    """Weights being staged on nodes, and stages that ended in the last hour: under way first, the least done
    first."""

    def as_json(self) -> dict[str, Any]:
        """The JSON form (`ctl_status --json`, `/api/v1/status`): every field by name, in order."""
        return asdict(self)
