"""LoRA adapters on base replicas (DESIGN "LoRA adapters"): which replica loads which adapter, and when it goes.

Routers ask for an adapter by its public name, like an activation, while they
hold a request for it that no replica can serve. The tick then:

* **starts or wakes the base** when it has no ready replica (`split_activations`
  hands the base's name to demand, which does what it does for any model);
* **assigns the adapter** (`assign_adapters`) to one ready replica of its base
  whose profile takes adapters: rendezvous hashing of (adapter, replica) orders
  them, so the choice is stable and spreads adapters evenly, and the first with
  a free slot takes it. When every one is full, the least recently used
  loaded adapter among them, with no requests in flight, is unloaded to make
  room (the agent runs the unload before the load: it runs a shard's adapter
  commands in order). A replica that is draining, asleep or waking is not
  READY, so it never loads one;
* **spreads a busy adapter** (`assign_adapters` too): one whose requests in
  flight (the routers' peaks) exceed its holders' target concurrency is
  loaded onto one more replica with a free slot;
* **forgets stale loads and unloads idle adapters** (`tend_loads`): loaded and
  unused past the base profile's idle timeout, only while usage is known
  (DESIGN invariant 3), or disabled.

Each load is an AdapterLoad row (loading → loaded, or unloading) written in
the tick's transaction, with its command (load_adapter / unload_adapter, fenced
and acknowledged like every command). The agent's adapter_status moves it on
(`record_adapter_statuses`); its heartbeats list what each engine holds
(`reconcile_held`), which corrects the rows after an engine restart or a lost
report. Routers see an adapter's replicas in the endpoint table once loaded.
"""

from __future__ import annotations

import logging
import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db.models import Case, F, FloatField, Q, Value, When

from catalog.models import Adapter, Profile
from hub.contracts import ADAPTER_STAMP_SEPARATOR, Activation
from nodewire.adapter_messages import AdapterStatus
from nodewire.parts import ShardHeartbeat
from reconciler.choices import AdapterLoadState, ReplicaState, ShardState
from reconciler.models import AdapterLoad, AdapterStats, Shard
from reconciler.outbox import Outbox

log = logging.getLogger(__name__)

HELD = (AdapterLoadState.LOADING, AdapterLoadState.LOADED)
"""Loads that take one of a replica's slots (an unloading one is freed first: see the module docstring)."""


def split_activations(activations: set[Activation]) -> tuple[set[Activation], set[int]]:
    """(the activations with each enabled adapter's name replaced by its base's, in the same pools; the ids of
    those adapters).

    One query, only when routers asked for something. Routers ask under public names, never aliases.
    """
    if not activations:
        return activations, set()
    found = list(
        Adapter.objects.filter(name__in={a.model for a in activations}, enabled=True, base__enabled=True).values_list(
            "pk", "name", "base__name"
        )
    )
    if not found:
        return activations, set()
    base_of = {name: base for _, name, base in found}
    models = {Activation(model=base_of.get(a.model, a.model), pools=a.pools) for a in activations}
    return models, {pk for pk, _, _ in found}


@dataclass
class _Slot:
    """A ready replica of a base that takes adapters, as the assignment sees it."""

    replica_id: int
    slots: int
    target_concurrency: int
    shard_id: int
    node_name: str
    held: list[AdapterLoad]


def assign_adapters(
    adapter_ids: set[int], now: datetime, outbox: Outbox, in_flight: dict[str, int] | None = None
) -> int:
    """Give each wanted adapter held by no ready replica one, and a busy adapter one more (see the module
    docstring); returns loads sent. `in_flight`: the routers' peaks by public name (adapters' among them).

    Three queries when some adapter is wanted or has requests in flight, plus the writes.
    """
    busy = {name: count for name, count in (in_flight or {}).items() if count}
    if not adapter_ids and not busy:
        return 0
    adapters = list(
        Adapter.objects.filter(Q(pk__in=adapter_ids) | Q(name__in=busy.keys(), enabled=True)).only(
            "pk", "name", "source", "base_id"
        )
    )
    if not adapters:
        return 0  # the names in flight are models'
    by_base = _ready_slots({a.base_id for a in adapters})
    new: list[AdapterLoad] = []
    victims: list[AdapterLoad] = []
    for adapter in sorted(adapters, key=lambda a: a.name):
        candidates = by_base.get(adapter.base_id, [])
        holders = [c for c in candidates if any(load.adapter_id == adapter.pk for load in c.held)]
        if not candidates:
            continue  # no ready replica yet: demand starts or wakes one
        if holders:
            chosen, victim = _spread(adapter, candidates, holders, busy.get(adapter.name, 0)), None
        else:
            chosen, victim = _choose(adapter, candidates, busy)
        if chosen is None:
            continue  # held where it is needed, or every slot of the best replica is loading: the next ask tries again
        if victim is not None:
            chosen.held.remove(victim)
            victims.append(victim)
            outbox.unload_adapter(chosen.node_name, chosen.shard_id, victim.adapter.name)
            log.info(
                "unloading adapter %s from replica %s: least recently used, for %s",
                victim.adapter.name, chosen.replica_id, adapter.name,
            )  # fmt: skip
        load = AdapterLoad(adapter=adapter, replica_id=chosen.replica_id, requested_at=now)
        chosen.held.append(load)
        new.append(load)
        outbox.load_adapter(chosen.node_name, chosen.shard_id, adapter.name, adapter.source)
        log.info("loading adapter %s onto replica %s", adapter.name, chosen.replica_id)
    if victims:
        AdapterLoad.objects.filter(pk__in=[v.pk for v in victims]).update(
            state=AdapterLoadState.UNLOADING, requested_at=now
        )
    AdapterLoad.objects.bulk_create(new)
    return len(new)


def _spread(adapter: Adapter, candidates: list[_Slot], holders: list[_Slot], in_flight: int) -> _Slot | None:
    """One more replica for an adapter whose requests in flight exceed its holders' target concurrency (their
    profile's), once every load of it has been answered: the next in rendezvous order with a free slot. None
    otherwise: spreading never unloads another adapter."""
    if any(load.adapter_id == adapter.pk and load.state != AdapterLoadState.LOADED for h in holders for load in h.held):
        return None
    if in_flight <= sum(h.target_concurrency for h in holders):
        return None
    ranked = sorted(candidates, key=lambda c: _score(adapter.name, c.replica_id), reverse=True)
    return next((c for c in ranked if c not in holders and len(c.held) < c.slots), None)


def _ready_slots(base_ids: set[int]) -> dict[int, list[_Slot]]:
    """Base model id -> its READY replicas whose profile takes adapters and whose head is ready, with their loads."""
    by_base: dict[int, list[_Slot]] = defaultdict(list)
    slots: dict[int, _Slot] = {}
    for replica_id, model_id, max_adapters, target, shard_id, node_name in Shard.objects.filter(
        rank=0,
        state=ShardState.READY,
        replica__state=ReplicaState.READY,
        replica__model_id__in=base_ids,
        replica__profile__max_adapters__gt=0,
    ).values_list(
        "replica_id",
        "replica__model_id",
        "replica__profile__max_adapters",
        "replica__profile__target_concurrency",
        "pk",
        "node__name",
    ):
        # max_adapters > 0 by the filter, so never None here.
        slots[replica_id] = _Slot(replica_id, max_adapters or 0, target, shard_id, node_name, [])
        by_base[model_id].append(slots[replica_id])
    for load in AdapterLoad.objects.filter(replica_id__in=slots, state__in=HELD).select_related("adapter"):
        slots[load.replica_id].held.append(load)
    return by_base


def _choose(adapter: Adapter, candidates: list[_Slot], busy: dict[str, int]) -> tuple[_Slot | None, AdapterLoad | None]:
    """(the replica to load `adapter` onto, the loaded adapter to unload from it first, if any).

    Rendezvous order; the first with a free slot. When every slot is taken: the least recently used loaded
    adapter over all of them (one cache of every slot, as an LRU oracle would), passing over those with
    requests in flight in the routers' last reports (`busy`: their stamps may not have arrived yet).
    """
    ranked = sorted(candidates, key=lambda c: _score(adapter.name, c.replica_id), reverse=True)
    for candidate in ranked:
        if len(candidate.held) < candidate.slots:
            return candidate, None
    loaded = [
        (load, candidate) for candidate in ranked for load in candidate.held if load.state == AdapterLoadState.LOADED
    ]
    idle = [(load, candidate) for load, candidate in loaded if not busy.get(load.adapter.name)]
    if not (idle or loaded):
        return None, None
    victim, chosen = min(idle or loaded, key=lambda pair: _last_touched(pair[0]))  # min keeps rendezvous order on ties
    return chosen, victim


def _score(adapter_name: str, replica_id: int) -> int:
    """Rendezvous hashing weight: stable across processes and restarts (unlike hash() of a str)."""
    return zlib.crc32(f"{adapter_name}{ADAPTER_STAMP_SEPARATOR}{replica_id}".encode())


def _last_touched(load: AdapterLoad) -> datetime:
    """When a load was last used, or loaded (never used since), for least-recently-used order."""
    return load.last_used or load.loaded_at or load.requested_at


def tend_loads(now: datetime, outbox: Outbox, *, usage_known: bool) -> int:
    """Forget stale loads, and unload idle and disabled adapters; returns how many unloads were sent.

    Stale: the replica's engine is gone or going (stopping, failed, pending again), or a load or unload the
    agent never answered (LLMGW_ADAPTER_LOAD_TIMEOUT_SECONDS: asked for again if still wanted). Unloaded:
    adapters loaded and unused past their base profile's idle timeout (only while usage is known, DESIGN
    invariant 3), and those an operator disabled. One read of the fleet's loads (a few per replica), plus
    the writes and one more read when some are due.
    """
    timeout = now - timedelta(seconds=settings.LLMGW_ADAPTER_LOAD_TIMEOUT_SECONDS)
    stale: list[int] = []
    due: list[AdapterLoad] = []
    for load in AdapterLoad.objects.select_related("adapter", "replica__profile").order_by("pk"):
        replica_state = load.replica.state
        if replica_state in _ENGINE_GONE or (load.state != AdapterLoadState.LOADED and load.requested_at < timeout):
            stale.append(load.pk)
        elif load.state == AdapterLoadState.LOADED and replica_state == ReplicaState.READY:
            after = _idle_after(load.replica.profile) if usage_known else None
            if not load.adapter.enabled or (
                after is not None and _last_touched(load) <= now - timedelta(seconds=after)
            ):
                due.append(load)
    if stale:
        AdapterLoad.objects.filter(pk__in=stale).delete()
        log.info("forgot %d adapter loads (their replica is gone, or the agent never answered)", len(stale))
    return _unload(due, now, outbox) if due else 0


# Replica states whose engine is gone or going: their loads mean nothing any more.
_ENGINE_GONE = (ReplicaState.STOPPING, ReplicaState.FAILED, ReplicaState.PENDING)


def _unload(loads: list[AdapterLoad], now: datetime, outbox: Outbox) -> int:
    """Send unload_adapter to the heads of the replicas holding `loads`, which turn unloading; how many were sent."""
    heads = {
        replica_id: (shard_id, node_name)
        for replica_id, shard_id, node_name in Shard.objects.filter(
            rank=0, replica_id__in={load.replica_id for load in loads}
        ).values_list("replica_id", "pk", "node__name")
    }
    sent = [load for load in loads if load.replica_id in heads]
    for load in sent:
        shard_id, node_name = heads[load.replica_id]
        outbox.unload_adapter(node_name, shard_id, load.adapter.name)
        why = "idle" if load.adapter.enabled else "disabled"
        log.info("unloading adapter %s from replica %s: %s", load.adapter.name, load.replica_id, why)
    AdapterLoad.objects.filter(pk__in=[load.pk for load in sent]).update(
        state=AdapterLoadState.UNLOADING, requested_at=now
    )
    return len(sent)


def _idle_after(profile: Profile) -> float | None:
    """Seconds unused after which an adapter on a replica of `profile` is unloaded (the profile's idle timeout)."""
    if profile.idle_timeout_seconds is None:
        return settings.LLMGW_DEFAULT_IDLE_TIMEOUT_SECONDS
    return float(profile.idle_timeout_seconds) or None


def record_adapter_statuses(node_id: int, statuses: Sequence[AdapterStatus], now: datetime) -> bool:
    """Apply the node's adapter_status reports to the loads of its own shards, and count the loads answered in
    their base's AdapterStats; return whether a load finished (so the endpoint table is worth publishing now)."""
    heads = {
        shard_id: (replica_id, model_id)
        for shard_id, replica_id, model_id in Shard.objects.filter(
            node_id=node_id, rank=0, pk__in={s.shard_id for s in statuses}
        ).values_list("pk", "replica_id", "replica__model_id")
    }
    loaded = False
    for status in statuses:
        if status.shard_id not in heads:
            continue  # not a shard of this node (a node speaks only for itself), or gone
        replica_id, model_id = heads[status.shard_id]
        rows = AdapterLoad.objects.filter(replica_id=replica_id, adapter__name=status.name)
        if status.state == "loaded":
            answered = rows.exclude(state=AdapterLoadState.UNLOADING).update(state="loaded", loaded_at=now)
            loaded |= bool(answered)
            _count(model_id, loaded=bool(answered), seconds=status.seconds)
        elif status.state == "unloaded":
            rows.filter(state=AdapterLoadState.UNLOADING).delete()
        else:
            log.warning("adapter %s failed on replica %s: %s", status.name, replica_id, status.message)
            if rows.filter(state=AdapterLoadState.LOADING).exists():
                _count(model_id, failed=True)
            rows.delete()
    return loaded


def _count(model_id: int, *, loaded: bool = False, failed: bool = False, seconds: float | None = None) -> None:
    """Add one answered load (timed `seconds`, folded into the learned load time) or one failure to the base's
    AdapterStats. Two queries."""
    if not (loaded or failed):
        return
    AdapterStats.objects.get_or_create(model_id=model_id)
    changes: dict = {"loads": F("loads") + 1} if loaded else {"failures": F("failures") + 1}
    if loaded and seconds is not None:
        changes["load_seconds"] = Case(
            When(load_seconds__isnull=True, then=Value(seconds)),
            default=(F("load_seconds") + Value(seconds)) / Value(2.0),
            output_field=FloatField(),
        )
    AdapterStats.objects.filter(model_id=model_id).update(**changes)


def reconcile_held(node_id: int, node_name: str, reported: Iterable[ShardHeartbeat], outbox: Outbox) -> int:
    """Correct the loads of the node's head shards by what their engines hold; returns rows changed.

    A loaded adapter its engine no longer holds (the engine restarted) is forgotten; a loading one it holds
    is loaded (its report was lost); one it holds that no load backs (deleted from the catalog while loaded,
    or forgotten) is unloaded, so it does not keep a slot the leader no longer counts. Nothing to do, no
    query: only engines with slots list adapters.
    """
    holds = {item.shard_id: set(item.adapters) for item in reported if isinstance(item.adapters, list)}
    if not holds:
        return 0
    heads = dict(
        Shard.objects.filter(node_id=node_id, rank=0, pk__in=holds, state=ShardState.READY).values_list(
            "replica_id", "pk"
        )
    )
    if not heads:
        return 0
    lost, found = [], []
    backed: dict[int, set[str]] = defaultdict(set)
    for pk, replica_id, name, state in AdapterLoad.objects.filter(replica_id__in=heads).values_list(
        "pk", "replica_id", "adapter__name", "state"
    ):
        backed[replica_id].add(name)
        held = name in holds[heads[replica_id]]
        if state == AdapterLoadState.LOADED and not held:
            lost.append(pk)
        elif state == AdapterLoadState.LOADING and held:
            found.append(pk)
    if lost:
        AdapterLoad.objects.filter(pk__in=lost).delete()
    if found:
        AdapterLoad.objects.filter(pk__in=found).update(state=AdapterLoadState.LOADED)
    for replica_id, shard_id in heads.items():
        for name in sorted(holds[shard_id] - backed[replica_id]):
            log.info("unloading adapter %s from replica %s: held by its engine, wanted by nobody", name, replica_id)
            outbox.unload_adapter(node_name, shard_id, name)
    return len(lost) + len(found)


def record_adapter_stamps(stamps: dict[str, float]) -> int:
    """Move routers' adapter stamps (`"<replica id>/<adapter>"`) into AdapterLoad.last_used; rows updated.

    One read and one bulk update, only when there are such stamps. Malformed keys are ignored.
    """
    wanted: dict[tuple[int, str], datetime] = {}
    for key, ts in stamps.items():
        replica, separator, name = key.partition(ADAPTER_STAMP_SEPARATOR)
        if not separator or not replica.isdigit() or not name:
            continue
        wanted[(int(replica), name)] = datetime.fromtimestamp(float(ts), tz=UTC)
    if not wanted:
        return 0
    changed = []
    replica_ids = {replica_id for replica_id, _ in wanted}
    for load in AdapterLoad.objects.filter(replica_id__in=replica_ids, state=AdapterLoadState.LOADED).select_related(
        "adapter"
    ):
        stamp = wanted.get((load.replica_id, load.adapter.name))
        if stamp is not None and (load.last_used is None or stamp > load.last_used):
            load.last_used = stamp
            changed.append(load)
    if changed:
        AdapterLoad.objects.bulk_update(changed, ["last_used"])
    return len(changed)
