"""Reconciler services: the leader's tick and the shard lifecycle the agents report.

Each public function is one transaction. Commands to agents are collected in
an outbox and sent only after commit (`transaction.on_commit`), so an agent
never acts on a placement that was rolled back. The tick runs a constant
number of queries whatever the fleet size: it reads each table once, decides
in memory (reconciler.placement) and writes in bulk.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Case, Exists, F, FloatField, OuterRef, Q, Value, When
from django.utils import timezone

from agent.protocol import SHARD_REPORT_STATES, START_SHARD, STOP_SHARD, command
from catalog.models import Alias, Profile
from catalog.models import Model as CatalogModel
from hub import get_hub
from inventory.choices import NodeState
from inventory.models import GPU, Node, gpu_in_service

from .choices import ReplicaState, ShardState
from .dispatch import send_to_nodes
from .lease import Leadership, LeaseLost, get_leadership
from .models import GPUAssignment, Lease, Replica, Shard
from .placement import NodeCapacity, Placement, Shape, Unplaceable, pick_port, place
from .signals import work_pending

log = logging.getLogger(__name__)

# A profile's replicas that count towards its min and max. FAILED ones count
# too: they come back as PENDING after their backoff, so replacing them at once
# would defeat the backoff and overshoot max when they return.
WANTED_STATES = (ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.READY, ReplicaState.FAILED)
LIVE_STATES = (ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.READY)
# When a profile has too many replicas, stop the ones holding least first.
_STOP_ORDER = {ReplicaState.FAILED: 0, ReplicaState.PENDING: 1, ReplicaState.STARTING: 2, ReplicaState.READY: 3}


@dataclass
class TickReport:
    """What one tick did. `leader` is False when this process did not hold the lease (and did nothing)."""

    leader: bool
    epoch: int = 0
    usage_updated: int = 0
    usage_forgotten: int = 0
    usage_idle_since_ready: int = 0
    nodes_unreachable: int = 0
    nodes_lost: int = 0
    replicas_failed: int = 0
    replicas_created: int = 0
    replicas_stopped: int = 0
    replicas_idle_stopped: int = 0
    replicas_retried: int = 0
    replicas_placed: int = 0
    replicas_unplaceable: int = 0
    replicas_deleted: int = 0
    starts_sent: int = 0
    starts_resent: int = 0
    stops_sent: int = 0
    published: bool = False
    unknown_activations: list[str] = field(default_factory=list)


class _Outbox:
    """Agent commands decided inside a transaction, sent after it commits."""

    def __init__(self, epoch: int | None = None):
        self.epoch = epoch
        self.commands: list[tuple[str, str, dict]] = []

    def start(self, node_name: str, **fields) -> None:
        self.commands.append((node_name, START_SHARD, fields))

    def stop(self, node_name: str, shard_id: int) -> None:
        self.commands.append((node_name, STOP_SHARD, {"shard_id": shard_id}))

    def send_on_commit(self) -> None:
        if not self.commands:
            return
        if self.epoch is None:
            # Agent-side fencing compares epochs: stamp with the lease row's current one.
            self.epoch = current_epoch()
        built = [(node, command(kind, self.epoch, **fields)) for node, kind, fields in self.commands]
        transaction.on_commit(lambda: _deliver(built))


def _deliver(commands: list[tuple[str, dict]]) -> None:
    try:
        failed = send_to_nodes(commands)
    except Exception:  # channel layer down: resends (starts) and the next tick (stops) cover it
        log.exception("could not send %d agent commands", len(commands))
        return
    for node_name, cmd, exc in failed:
        log.error("could not send %s to node %s: %s", cmd["type"], node_name, exc)


def backoff_seconds(failure_count: int) -> float:
    """Delay before retrying a replica that has failed `failure_count` times (exponential, capped)."""
    base, cap = settings.LLMGW_BACKOFF_BASE_SECONDS, settings.LLMGW_BACKOFF_MAX_SECONDS
    exponent = min(max(failure_count - 1, 0), 62)  # past the cap anyway; keeps the float finite
    return min(base * 2.0**exponent, cap)


def current_epoch() -> int:
    """The lease row's epoch (0 when nobody has ever led)."""
    return Lease.objects.filter(name=settings.LLMGW_LEASE_NAME).values_list("epoch", flat=True).first() or 0


# --- shared row changes ------------------------------------------------------


def _fail_replicas(
    replica_ids, message: str, now: datetime, outbox: _Outbox, *, silent_shard_ids=(), dead_node_ids=()
) -> int:
    """Mark replicas FAILED with backoff, drop their shards and GPUs, stop their surviving engines.

    STOPPING replicas are deleted instead: they were going away anyway.
    `silent_shard_ids` and shards on `dead_node_ids` get no stop_shard (their
    engine is already gone). Returns how many replicas were failed.
    """
    replica_ids = set(replica_ids)
    if not replica_ids:
        return 0
    replicas = list(Replica.objects.filter(pk__in=replica_ids))
    shards = Shard.objects.filter(replica_id__in=replica_ids).values_list("id", "node_id", "node__name", "state")
    for shard_id, node_id, node_name, state in shards:
        if shard_id not in silent_shard_ids and node_id not in dead_node_ids and state != ShardState.STOPPED:
            outbox.stop(node_name, shard_id)
    failed = [r for r in replicas if r.state != ReplicaState.STOPPING]
    for replica in failed:
        replica.state = ReplicaState.FAILED
        replica.failure_count += 1
        replica.next_attempt_at = now + timedelta(seconds=backoff_seconds(replica.failure_count))
        replica.last_error = message
        replica.endpoint_url = ""
        replica.ready_at = None
    if failed:
        Replica.objects.bulk_update(
            failed, ["state", "failure_count", "next_attempt_at", "last_error", "endpoint_url", "ready_at"]
        )
    Shard.objects.filter(replica_id__in=replica_ids).delete()
    going = [r.pk for r in replicas if r.state == ReplicaState.STOPPING]
    if going:
        Replica.objects.filter(pk__in=going).delete()
    if failed:
        log.warning("replicas %s failed: %s", sorted(r.pk for r in failed), message)
    return len(failed)


def _stop_replicas(replicas) -> tuple[int, int]:
    """Stop replicas: those without shards are deleted at once, the rest become STOPPING.

    The leader's next dispatch sends stop_shard to STOPPING replicas' shards.
    Returns (deleted, stopping).
    """
    ids = {r.pk for r in replicas if r.state != ReplicaState.STOPPING}
    if not ids:
        return 0, 0
    with_shards = set(Shard.objects.filter(replica_id__in=ids).values_list("replica_id", flat=True))
    idle = ids - with_shards
    if idle:
        Replica.objects.filter(pk__in=idle).delete()
    if with_shards:
        Replica.objects.filter(pk__in=with_shards).update(state=ReplicaState.STOPPING, endpoint_url="")
    return len(idle), len(with_shards)


def _start_fields(shard: Shard, replica: Replica, node_count: int, head_address: str, gpu_indices) -> dict:
    """The start_shard fields of agent.protocol for one shard."""
    return {
        "shard_id": shard.pk,
        "replica_id": replica.pk,
        "rank": shard.rank,
        "node_count": node_count,
        "head_address": head_address,
        "engine": replica.profile.engine,
        "model": replica.model.name,
        "source": replica.model.source,
        "gpu_indices": sorted(gpu_indices),
        "port": shard.port,
        "args": list(replica.profile.engine_args or []),
        "env": {},
    }


# --- the tick ----------------------------------------------------------------


def tick(leadership: Leadership | None = None, hub=None, now: datetime | None = None) -> TickReport:
    """One reconcile pass, leader only (DESIGN "Reconcile tick").

    renew lease → collect usage → node liveness → shard start timeouts → demand
    → retry failed → resend unanswered starts → place pending → stop shards of
    stopping replicas → (commit) → send commands → publish endpoints if changed.
    All row changes are one transaction fenced by the lease epoch.
    """
    leadership = leadership or get_leadership()
    if not leadership.renew():
        return TickReport(leader=False)
    hub = hub or get_hub()
    now = now or timezone.now()
    report = TickReport(leader=True, epoch=leadership.epoch)
    try:
        stamps = hub.collect_usage()
    except Exception as exc:  # usage store down: last_used just stays as it was this tick
        log.warning("could not collect usage: %s", exc)
        stamps = {}
    try:
        watching_since = hub.watching_since()
    except Exception as exc:  # unknown stays unknown
        log.warning("could not read since when usage is watched: %s", exc)
        watching_since = None
    try:
        activations = hub.drain_activations()
    except Exception as exc:
        log.warning("could not read activations: %s", exc)
        activations = set()

    outbox = _Outbox(leadership.epoch)
    try:
        with transaction.atomic():
            leadership.assert_still_leader()
            forget = _collect_usage(stamps, report)
            report.usage_idle_since_ready = _mark_unused_since_ready(watching_since)
            _check_liveness(now, leadership, report, outbox)
            _fail_slow_starts(now, report, outbox)
            _apply_demand(activations, now, report)
            report.replicas_retried = (
                Replica.objects.filter(state=ReplicaState.FAILED)
                .filter(Q(next_attempt_at__lte=now) | Q(next_attempt_at__isnull=True))
                .update(state=ReplicaState.PENDING)
            )
            _resend_starts(now, report, outbox)
            _place_pending(now, leadership.epoch, report, outbox)
            _stop_shards(now, report, outbox)
            outbox.send_on_commit()
    except LeaseLost as exc:
        log.warning("tick abandoned, nothing committed: %s", exc)
        leadership.held = False
        return TickReport(leader=False, epoch=report.epoch)

    if forget:
        try:
            hub.forget_usage(forget)
        except Exception as exc:
            log.warning("could not forget usage stamps: %s", exc)
    try:
        report.published = hub.publish_endpoints(build_endpoint_table())
    except Exception as exc:  # routers keep their last table and poll as a backstop
        log.warning("could not publish endpoints: %s", exc)
    return report


def _collect_usage(stamps: dict[str, float], report: TickReport) -> list[str]:
    """Move newer usage stamps into Replica.last_used; return stamps of replicas that no longer exist."""
    if not stamps:
        return []
    known = dict(Replica.objects.values_list("id", "last_used"))
    changed, forget = [], []
    for key, ts in stamps.items():
        try:
            replica_id = int(key)
            stamp = datetime.fromtimestamp(float(ts), tz=UTC)
        except (TypeError, ValueError, OverflowError, OSError):
            log.warning("ignoring malformed usage stamp %r=%r", key, ts)
            forget.append(key)
            continue
        if replica_id not in known:
            forget.append(key)
        elif known[replica_id] is None or stamp > known[replica_id]:
            changed.append(Replica(pk=replica_id, last_used=stamp))
    if changed:
        Replica.objects.bulk_update(changed, ["last_used"])
    report.usage_updated, report.usage_forgotten = len(changed), len(forget)
    return forget


def _mark_unused_since_ready(watching_since: float | None) -> int:
    """Replicas that became ready while routers were watching, and have no stamp, are idle since ready.

    DESIGN invariant 3: only then is "never used" a fact; a replica that became
    ready before the current watch began keeps an unknown last use. One query.
    """
    if watching_since is None:
        return 0
    since = datetime.fromtimestamp(watching_since, tz=UTC)
    return Replica.objects.ready().filter(last_used__isnull=True, ready_at__gte=since).update(
        last_used=F("ready_at")
    )


def _check_liveness(now: datetime, leadership: Leadership, report: TickReport, outbox: _Outbox) -> None:
    """READY → UNREACHABLE after a silence; → LOST after a longer one, failing the replicas it held."""
    silent = Q(last_seen__isnull=True) | Q(
        last_seen__lt=now - timedelta(seconds=settings.LLMGW_UNREACHABLE_AFTER_SECONDS)
    )
    report.nodes_unreachable = Node.objects.filter(silent, state=NodeState.READY).update(state=NodeState.UNREACHABLE)
    window = timedelta(seconds=settings.LLMGW_UNREACHABLE_AFTER_SECONDS)
    if leadership.leader_since is None or now - leadership.leader_since < window:
        # A new leader has not watched heartbeats for a whole window: the
        # silence it sees may be its own (DESIGN invariant 1).
        return
    lost = Q(last_seen__isnull=True) | Q(last_seen__lt=now - timedelta(seconds=settings.LLMGW_LOST_AFTER_SECONDS))
    lost_ids = list(
        Node.objects.filter(lost, state__in=[NodeState.READY, NodeState.UNREACHABLE]).values_list("id", flat=True)
    )
    if not lost_ids:
        return
    report.nodes_lost = Node.objects.filter(pk__in=lost_ids).update(state=NodeState.LOST)
    replica_ids = set(Shard.objects.filter(node_id__in=lost_ids).values_list("replica_id", flat=True))
    report.replicas_failed += _fail_replicas(
        replica_ids, "node lost: no heartbeat", now, outbox, dead_node_ids=set(lost_ids)
    )


def _fail_slow_starts(now: datetime, report: TickReport, outbox: _Outbox) -> None:
    timeout = settings.LLMGW_SHARD_START_TIMEOUT_SECONDS
    replica_ids = set(
        Shard.objects.filter(
            state__in=[ShardState.ASSIGNED, ShardState.STARTING],
            replica__state=ReplicaState.STARTING,
            replica__started_at__lt=now - timedelta(seconds=timeout),
        ).values_list("replica_id", flat=True)
    )
    report.replicas_failed += _fail_replicas(replica_ids, f"not ready within {timeout:g} s of placement", now, outbox)


def _apply_demand(activations: set[str], now: datetime, report: TickReport) -> None:
    """Keep each profile between min and max replicas, honour activations, stop disabled models.

    Above min replicas, a READY replica unused for longer than its profile's idle
    timeout is stopped. Only a known last use counts: a replica whose last use is
    unknown is never stopped for idleness (DESIGN invariant 3).
    """
    profiles = list(Profile.objects.select_related("model").order_by("model_id", "order", "id"))
    replicas = list(
        Replica.objects.exclude(state=ReplicaState.STOPPING).only("id", "model_id", "profile_id", "state", "last_used")
    )
    by_profile: dict[int, list[Replica]] = defaultdict(list)
    for replica in replicas:
        by_profile[replica.profile_id].append(replica)

    to_create: list[Replica] = []
    to_stop: list[Replica] = []
    first_profile: dict[str, Profile] = {}
    wanted_by_model: dict[int, int] = defaultdict(int)
    for profile in profiles:
        mine = by_profile.get(profile.pk, [])
        if not profile.model.enabled:
            to_stop.extend(mine)
            continue
        first_profile.setdefault(profile.model.name, profile)
        wanted = [r for r in mine if r.state in WANTED_STATES]
        if len(wanted) < profile.min_replicas:
            to_create.extend(
                Replica(model_id=profile.model_id, profile=profile) for _ in range(profile.min_replicas - len(wanted))
            )
        elif len(wanted) > profile.max_replicas:
            # Newest first within a state: keep the replicas that have been serving longest.
            ranked = sorted(wanted, key=lambda r: (_STOP_ORDER[r.state], -r.pk))
            excess = len(wanted) - profile.max_replicas
            to_stop.extend(ranked[:excess])
            wanted = ranked[excess:]
        if profile.idle_timeout_seconds is not None and len(wanted) > profile.min_replicas:
            cutoff = now - timedelta(seconds=profile.idle_timeout_seconds)
            idle = sorted(
                (r for r in wanted if r.state == ReplicaState.READY and r.last_used is not None and r.last_used < cutoff),
                key=lambda r: r.last_used,
            )[: len(wanted) - profile.min_replicas]
            to_stop.extend(idle)
            report.replicas_idle_stopped += len(idle)
            wanted = [r for r in wanted if r not in idle]
        wanted_by_model[profile.model_id] += max(len(wanted), profile.min_replicas)

    if activations:
        unresolved = activations - first_profile.keys()
        names = {name: name for name in activations}
        if unresolved:
            names.update(Alias.objects.filter(name__in=unresolved).values_list("name", "model__name"))
        for requested in sorted(activations):
            profile = first_profile.get(names[requested])
            if profile is None:
                report.unknown_activations.append(requested)
                continue
            if wanted_by_model[profile.model_id] == 0:
                to_create.append(Replica(model_id=profile.model_id, profile=profile))
                wanted_by_model[profile.model_id] = 1
        if report.unknown_activations:
            log.warning("activation requested for unknown or disabled models: %s", report.unknown_activations)

    if to_create:
        Replica.objects.bulk_create(to_create)
        report.replicas_created = len(to_create)
    deleted, stopping = _stop_replicas(to_stop)
    report.replicas_deleted += deleted
    report.replicas_stopped += stopping


def _resend_starts(now: datetime, report: TickReport, outbox: _Outbox) -> None:
    """Send start_shard again for shards that have not answered (the agent treats a repeat as idempotent)."""
    due = list(
        Shard.objects.filter(
            state=ShardState.ASSIGNED,
            replica__state=ReplicaState.STARTING,
            updated_at__lt=now - timedelta(seconds=settings.LLMGW_START_RESEND_SECONDS),
        ).select_related("replica__model", "replica__profile", "node")
    )
    if not due:
        return
    replica_ids = {s.replica_id for s in due}
    peers: dict[int, list[Shard]] = defaultdict(list)
    for peer in Shard.objects.filter(replica_id__in=replica_ids).select_related("node"):
        peers[peer.replica_id].append(peer)
    gpus: dict[int, list[int]] = defaultdict(list)
    for shard_id, index in GPUAssignment.objects.filter(shard__in=due).values_list("shard_id", "gpu__index"):
        gpus[shard_id].append(index)
    for shard in due:
        mates = peers[shard.replica_id]
        head = min(mates, key=lambda s: s.rank).node
        fields = _start_fields(shard, shard.replica, len(mates), head.address or head.name, gpus[shard.pk])
        outbox.start(shard.node.name, **fields)
    Shard.objects.filter(pk__in=[s.pk for s in due]).update(updated_at=now)
    report.starts_resent = len(due)


def _free_capacity(now: datetime) -> tuple[dict[tuple[int, str], dict], dict[str, set[int]]]:
    """Free GPUs per (node, class) on ready, schedulable nodes, and the engine ports in use per host address.

    Ports are counted per address, not per node: nodes sharing an address (simulated
    nodes on one box) share one port space.

    A GPU is free when healthy, out of quarantine and unassigned (DESIGN invariant 5).
    Two queries whatever the fleet size.
    """
    rows = (
        GPU.objects.filter(node__in=Node.objects.schedulable())
        .annotate(held=Exists(GPUAssignment.objects.filter(gpu=OuterRef("pk"))))
        .values_list(
            "id",
            "index",
            "gpu_class",
            "health",
            "healthy_since",
            "held",
            "node_id",
            "node__name",
            "node__fabric",
            "node__address",
        )
        .order_by("node_id", "index")
    )
    capacity: dict[tuple[int, str], dict] = {}
    for gpu_id, index, gpu_class, health, healthy_since, held, node_id, name, fabric, address in rows:
        entry = capacity.setdefault(
            (node_id, gpu_class),
            {"node_id": node_id, "name": name, "fabric": fabric, "address": address or name, "total": 0, "free": {}},
        )
        entry["total"] += 1
        if gpu_in_service(health, healthy_since, now) and not held:
            entry["free"][index] = gpu_id
    ports: dict[str, set[int]] = defaultdict(set)
    for address, name, port in Shard.objects.values_list("node__address", "node__name", "port"):
        ports[address or name].add(port)
    return capacity, ports


def _capacity_record(entry: dict, gpu_class: str) -> NodeCapacity:
    return NodeCapacity(entry["name"], entry["fabric"], entry["address"], gpu_class, tuple(sorted(entry["free"])), entry["total"])


@dataclass
class _NewShard:
    """A shard being placed this tick, with what its start command needs."""

    shard: Shard
    node_name: str
    address: str
    gpu_ids: list[int]
    indices: tuple[int, ...]


def _place_pending(now: datetime, epoch: int, report: TickReport, outbox: _Outbox) -> None:
    """Place PENDING replicas in profile order, then priority, then age; bulk-write shards and GPU assignments."""
    pending = list(
        Replica.objects.filter(state=ReplicaState.PENDING, model__enabled=True)
        .select_related("model", "profile")
        .order_by("profile__order", "-profile__priority", "created_at", "id")
    )
    if not pending:
        return
    capacity, ports = _free_capacity(now)
    by_class: dict[str, dict[str, dict]] = defaultdict(dict)
    records: dict[str, dict[str, NodeCapacity]] = defaultdict(dict)
    for (_, gpu_class), entry in capacity.items():
        by_class[gpu_class][entry["name"]] = entry
        records[gpu_class][entry["name"]] = _capacity_record(entry, gpu_class)
    port_range = settings.LLMGW_ENGINE_PORT_RANGE

    placed: list[tuple[Replica, list[_NewShard]]] = []
    unplaceable: list[Replica] = []
    for replica in pending:
        profile = replica.profile
        shape = Shape(profile.gpu_class, profile.gpus_per_node, profile.nodes_per_replica)
        by_name = by_class.get(profile.gpu_class, {})
        result = place(list(records[profile.gpu_class].values()), shape)
        if isinstance(result, Placement):
            chosen_ports = []
            for shard in result.shards:
                # A replica has at most one shard per node, so only that host's ports matter.
                port = pick_port(ports[by_name[shard.node]["address"]], port_range)
                if port is None:
                    result = Unplaceable(f"no free engine port on {shard.node} in {port_range[0]}-{port_range[1]}")
                    break
                chosen_ports.append(port)
        if isinstance(result, Unplaceable):
            report.replicas_unplaceable += 1
            if replica.placement_error != result.reason:
                replica.placement_error = result.reason
                unplaceable.append(replica)
            continue
        shards = []
        for rank, (shard_place, port) in enumerate(zip(result.shards, chosen_ports, strict=True)):
            entry = by_name[shard_place.node]
            gpu_ids = [entry["free"].pop(index) for index in shard_place.gpu_indices]
            records[profile.gpu_class][entry["name"]] = _capacity_record(entry, profile.gpu_class)
            ports[entry["address"]].add(port)
            shard = Shard(replica=replica, node_id=entry["node_id"], rank=rank, port=port, state=ShardState.ASSIGNED)
            shards.append(_NewShard(shard, entry["name"], entry["address"], gpu_ids, shard_place.gpu_indices))
        placed.append((replica, shards))

    if placed:
        new_shards = [new for _, shards in placed for new in shards]
        Shard.objects.bulk_create([new.shard for new in new_shards])
        GPUAssignment.objects.bulk_create(
            [GPUAssignment(gpu_id=gpu_id, shard=new.shard) for new in new_shards for gpu_id in new.gpu_ids]
        )
        # Every placed replica changes the same way: one UPDATE, not one CASE per row.
        Replica.objects.filter(pk__in=[replica.pk for replica, _ in placed]).update(
            state=ReplicaState.STARTING, started_at=now, epoch=epoch, placement_error="", endpoint_url="", ready_at=None
        )
    if unplaceable:
        Replica.objects.bulk_update(unplaceable, ["placement_error"])
    for replica, shards in placed:
        for new in shards:
            outbox.start(
                new.node_name, **_start_fields(new.shard, replica, len(shards), shards[0].address, new.indices)
            )
            report.starts_sent += 1
    report.replicas_placed = len(placed)


def _stop_shards(now: datetime, report: TickReport, outbox: _Outbox) -> None:
    """Send stop_shard for STOPPING replicas' shards (again if unanswered); delete replicas with none left."""
    resend_before = now - timedelta(seconds=settings.LLMGW_START_RESEND_SECONDS)
    due = list(
        Shard.objects.filter(replica__state=ReplicaState.STOPPING)
        .exclude(state=ShardState.STOPPED)
        .filter(~Q(state=ShardState.STOPPING) | Q(updated_at__lt=resend_before))
        .values_list("id", "node__name")
    )
    for shard_id, node_name in due:
        outbox.stop(node_name, shard_id)
    if due:
        Shard.objects.filter(pk__in=[shard_id for shard_id, _ in due]).update(state=ShardState.STOPPING, updated_at=now)
    report.stops_sent += len(due)
    empty = Replica.objects.filter(~Exists(Shard.objects.filter(replica=OuterRef("pk"))), state=ReplicaState.STOPPING)
    _, deleted = empty.delete()
    report.replicas_deleted += deleted.get(Replica._meta.label, 0)


# --- publishing ----------------------------------------------------------------


def build_endpoint_table() -> dict:
    """The endpoint list routers serve from: enabled models with a profile (and why a model cannot be
    placed, when it cannot, and how long it takes to start), and READY replicas. Five queries."""
    models = (
        CatalogModel.objects.filter(enabled=True)
        .filter(Exists(Profile.objects.filter(model=OuterRef("pk"))))
        .prefetch_related("aliases", "profiles")
        .order_by("name")
    )
    endpoints = (
        Replica.objects.ready().filter(model__enabled=True)
        .select_related("model", "profile")
        .order_by("id")
    )
    # Why a wanted model has no room right now, so routers can answer at once instead of holding requests.
    unplaceable: dict[str, str] = {}
    for name, reason in (
        Replica.objects.filter(state=ReplicaState.PENDING, model__enabled=True)
        .exclude(placement_error="")
        .order_by("model__name", "profile__order", "id")
        .values_list("model__name", "placement_error")
    ):
        unplaceable.setdefault(name, reason)

    def entry(model) -> dict:
        described = {"aliases": sorted(a.name for a in model.aliases.all())}
        if model.name in unplaceable:
            described["unplaceable"] = unplaceable[model.name]
        # The first profile is the one an activation starts, so its learned start time is the ETA.
        first = min(model.profiles.all(), key=lambda p: (p.order, p.pk), default=None)
        if first is not None and first.start_seconds is not None:
            described["start_seconds"] = round(first.start_seconds, 1)
        return described

    return {
        "models": {m.name: entry(m) for m in models},
        "endpoints": [
            {
                "replica_id": str(r.pk),
                "model": r.model.name,
                "url": r.endpoint_url,
                "priority": r.profile.priority,
                "weight": r.profile.weight,
                "pool": r.profile.pool,
            }
            for r in endpoints
        ],
    }


# --- what agents report --------------------------------------------------------


def _wake_on_commit() -> None:
    # The embedded ticker publishes the new endpoint list without waiting a whole interval.
    transaction.on_commit(lambda: work_pending.send(sender=None))


def _apply_shard_status(
    shard: Shard, state: str, message: str, port: int | None, now: datetime, outbox: _Outbox
) -> bool:
    """Apply one report about a shard known to be on the reporting node; return whether to wake the ticker."""
    replica = shard.replica
    node_name = shard.node.name
    if state == "stopped" or (state == "failed" and replica.state == ReplicaState.STOPPING):
        shard.delete()
        if replica.state == ReplicaState.STOPPING:
            if not Shard.objects.filter(replica_id=replica.pk).exists():
                replica.delete()
            return False
        if replica.state in (ReplicaState.STARTING, ReplicaState.READY):
            # An engine of a wanted replica went away: the replica cannot serve whole.
            _fail_replicas([replica.pk], message or f"shard {shard.pk} stopped on {node_name}", now, outbox)
            return True
        return False
    if replica.state == ReplicaState.STOPPING:
        return False  # a late "starting"/"ready" changes nothing for a replica going away
    if state == "failed":
        shard.state, shard.message = ShardState.FAILED, message
        shard.save(update_fields=["state", "message", "updated_at"])
        _fail_replicas(
            [replica.pk], message or f"shard {shard.pk} failed on {node_name}", now, outbox, silent_shard_ids={shard.pk}
        )
        return True
    if state == "starting":
        if shard.state == ShardState.ASSIGNED:
            shard.state = ShardState.STARTING
            shard.save(update_fields=["state", "updated_at"])
        return False
    # ready
    if port is not None and port != shard.port:
        log.warning(
            "shard %s on %s reports port %s, placed on %s; keeping %s",
            shard.pk,
            node_name,
            port,
            shard.port,
            shard.port,
        )
    if shard.state != ShardState.READY:
        shard.state, shard.message = ShardState.READY, ""
        shard.save(update_fields=["state", "message", "updated_at"])
    if replica.state != ReplicaState.STARTING:
        return False
    peers = list(Shard.objects.filter(replica_id=replica.pk).select_related("node").order_by("rank"))
    if not all(p.state == ShardState.READY for p in peers):
        return False
    head = peers[0]
    replica.state = ReplicaState.READY
    replica.ready_at = now
    replica.endpoint_url = f"http://{head.node.address or head.node.name}:{head.port}"
    replica.save(update_fields=["state", "ready_at", "endpoint_url"])
    if replica.started_at is not None:
        _learn_start_time(replica.profile_id, (now - replica.started_at).total_seconds())
    return True


def _learn_start_time(profile_id: int, seconds: float) -> None:
    """Fold one start's duration into the profile's estimate (half old, half new), in one UPDATE.

    Routers turn the estimate into Retry-After for clients a cold start turned away.
    """
    seconds = max(0.0, seconds)
    Profile.objects.filter(pk=profile_id).update(
        start_seconds=Case(
            When(start_seconds__isnull=True, then=Value(seconds)),
            default=(F("start_seconds") + Value(seconds)) / Value(2.0),
            output_field=FloatField(),
        )
    )


def record_shard_status(node: Node, shard_id: int, state: str, message: str = "", port: int | None = None) -> None:
    """Record an agent's shard_status report (starting / ready / failed / stopped) in one transaction.

    Reports about shards that are not on `node` are logged and ignored: a node
    speaks only for itself.
    """
    if state not in SHARD_REPORT_STATES:
        raise ValueError(f"shard state “{state}” is not one of {', '.join(SHARD_REPORT_STATES)}")
    if isinstance(shard_id, bool) or not isinstance(shard_id, int):
        raise ValueError(f"shard_id must be an integer, got {shard_id!r}")
    outbox = _Outbox()
    with transaction.atomic():
        shard = (
            Shard.objects.select_for_update()
            .select_related("replica", "node")
            .filter(pk=shard_id, node_id=node.pk)
            .first()
        )
        if shard is None:
            log.info("node %s reported shard %s as %s, but no such shard is on it; ignored", node.name, shard_id, state)
            return
        if _apply_shard_status(shard, state, message or "", port, timezone.now(), outbox):
            _wake_on_commit()
        outbox.send_on_commit()


def reconcile_reported_shards(node: Node, reported: list[dict]) -> None:
    """Match what an agent says it runs (on hello) against the shard rows for its node.

    Known and reported: kept, with the reported state applied. Reported but
    unknown: stopped (orphans). Expected but not reported: the agent lost its
    engines, so their replicas fail and back off.
    """
    if not isinstance(reported, list):
        raise ValueError("reported shards must be a list")
    for i, item in enumerate(reported):
        if (
            not isinstance(item, dict)
            or isinstance(item.get("shard_id"), bool)
            or not isinstance(item.get("shard_id"), int)
        ):
            raise ValueError(f"reported shard {i} needs an integer shard_id")
    now = timezone.now()
    outbox = _Outbox()
    wake = False
    with transaction.atomic():
        expected = {
            s.pk: s for s in Shard.objects.select_for_update().select_related("replica", "node").filter(node_id=node.pk)
        }
        reported_ids = set()
        for item in reported:
            shard_id = item["shard_id"]
            reported_ids.add(shard_id)
            shard = expected.get(shard_id)
            if shard is None:
                outbox.stop(node.name, shard_id)
                continue
            state = item.get("state")
            # One shard per replica per node, so applying one report never deletes another expected shard.
            if state in SHARD_REPORT_STATES:
                wake |= _apply_shard_status(shard, state, "", item.get("port"), now, outbox)
        missing = [s for shard_id, s in expected.items() if shard_id not in reported_ids]
        going = [s.pk for s in missing if s.replica.state == ReplicaState.STOPPING]
        if going:
            Shard.objects.filter(pk__in=going).delete()
            Replica.objects.filter(
                ~Exists(Shard.objects.filter(replica=OuterRef("pk"))),
                state=ReplicaState.STOPPING,
                pk__in={s.replica_id for s in missing},
            ).delete()
        # A start the agent never answered may simply not have reached it (it was between
        # connections): send it again at the next tick rather than failing the replica.
        unanswered = [s.pk for s in missing if s.state == ShardState.ASSIGNED and s.replica.state != ReplicaState.STOPPING]
        if unanswered:
            resend_due = now - timedelta(seconds=settings.LLMGW_START_RESEND_SECONDS)
            Shard.objects.filter(pk__in=unanswered).update(updated_at=resend_due)
            wake = True
        lost = {
            s.replica_id
            for s in missing
            if s.replica.state != ReplicaState.STOPPING and s.state != ShardState.ASSIGNED
        }
        if lost:
            _fail_replicas(
                lost,
                f"agent on {node.name} no longer runs shard(s) "
                f"{', '.join(str(s.pk) for s in missing if s.replica_id in lost)}",
                now,
                outbox,
                silent_shard_ids={s.pk for s in missing if s.replica_id in lost},
            )
            wake = True
        if wake:
            _wake_on_commit()
        outbox.send_on_commit()


def stop_orphan_shards(node_id: int, node_name: str, reported: list[dict]) -> int:
    """Stop engines an agent reports (in a heartbeat) whose shard rows no longer exist.

    Shard ids reach agents only after their rows commit, so an id the rows do
    not know was deleted (its replica failed or was removed with its profile or
    model): the engine is an orphan holding GPUs. One query. Returns how many
    stops were sent.
    """
    reported_ids = {item["shard_id"] for item in reported}
    if not reported_ids:
        return 0
    known = set(Shard.objects.filter(node_id=node_id, pk__in=reported_ids).values_list("pk", flat=True))
    orphans = sorted(reported_ids - known)
    if orphans:
        log.warning("node %s runs shard(s) %s that no replica owns; stopping them", node_name, orphans)
        outbox = _Outbox()
        with transaction.atomic():
            for shard_id in orphans:
                outbox.stop(node_name, shard_id)
            outbox.send_on_commit()
    return len(orphans)


def stop_replica(replica: Replica) -> None:
    """Stop a replica (admin action): one without shards is deleted at once, else it becomes STOPPING.

    The leader's next tick sends stop_shard to its shards.
    """
    with transaction.atomic():
        current = Replica.objects.select_for_update().filter(pk=replica.pk).first()
        if current is None:
            return
        _stop_replicas([current])
        _wake_on_commit()
