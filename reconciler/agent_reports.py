"""What agents report about their shards, applied to the rows (one transaction per batch or report).

`record_shard_statuses` takes a batch of `shard_status` reports;
`reconcile_reported_shards_of_nodes` matches the shards hellos say are running
against their nodes' rows;
`stop_orphan_shards` stops engines a heartbeat reports that no row owns;
`record_running` keeps each shard's requests in flight as its engine last
reported them. A node speaks only for itself: reports about shards on other
nodes are ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta

from django.conf import settings
from django.db import DatabaseError, transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from inventory.models import Node
from nodewire.parts import RunningShard, ShardHeartbeat
from nodewire.protocol import SHARD_REPORT_STATES, ShardStatus
from reconciler.catalog_changes import publish_endpoint_table
from reconciler.choices import ReplicaState, ShardState
from reconciler.hibernate.tier import sleep_report
from reconciler.lifecycle.transitions import fail_replicas, mark_ready_if_whole, notify_work_pending, start_followers
from reconciler.models import BusyPort, Replica, Shard
from reconciler.outbox import Outbox

log = logging.getLogger(__name__)


def _apply_shard_status(
    shard: Shard, state: str, message: str, port: int | None, now: datetime, outbox: Outbox, *, port_busy=False
) -> bool:
    """Apply one report about a shard known to be on the reporting node; return whether to wake the ticker."""
    replica = shard.replica
    node_name = shard.node.name
    shard_id = shard.pk  # delete() forgets it
    if state == "stopped" or (state == "failed" and replica.state == ReplicaState.STOPPING):
        shard.delete()
        if replica.state == ReplicaState.STOPPING:
            if not Shard.objects.filter(replica_id=replica.pk).exists():
                replica.delete()
                return False
            # A head gone: its other ranks are due for their drain (lifecycle.stop_shards).
            return shard.rank == 0
        if replica.state in (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.SLEEPING, ReplicaState.WAKING):
            # The agent stopped an engine nobody asked it to stop (it is shutting down):
            # the replica cannot serve whole, through no fault of its own.
            message = message or f"shard {shard_id} stopped on {node_name}"
            fail_replicas([replica.pk], message, now, outbox, node_fault=True)
            return True
        return False
    if replica.state == ReplicaState.STOPPING:
        return False  # a late "starting"/"ready" changes nothing for a replica going away
    if state == "failed":
        shard.state, shard.message = ShardState.FAILED, message
        shard.save(update_fields=["state", "message", "updated_at"])
        if port_busy:
            _mark_port_busy(shard, now)
        message = message or f"shard {shard.pk} failed on {node_name}"
        fail_replicas([replica.pk], message, now, outbox, node_fault=port_busy, silent_shard_ids={shard.pk})
        return True
    sleep = sleep_report(shard, state, now)
    if sleep is not None:
        return sleep
    first_word = shard.state == ShardState.ASSIGNED
    if first_word and shard.rank == 0 and replica.profile.nodes_per_replica > 1:
        # Its engine runs now: the other ranks can join it (lifecycle.start_followers). The profile's
        # shape only saves single-node replicas a query; resend_starts starts followers whatever it says.
        start_followers(replica.pk, outbox)
    if state == "starting":
        if first_word:
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
    return mark_ready_if_whole(replica, now)


def _mark_port_busy(shard: Shard, now: datetime) -> None:
    """The shard's port is taken on its node by something else: keep the placer off it for a while."""
    until = now + timedelta(seconds=settings.LLMGW_BUSY_PORT_SECONDS)
    BusyPort.objects.update_or_create(node_id=shard.node_id, port=shard.port, defaults={"until": until})
    log.warning("port %s is busy on node %s; not using it there until %s", shard.port, shard.node.name, until)


def record_shard_statuses(reports: Sequence[tuple[int, str, ShardStatus]]) -> None:
    """Record (node id, node name, report) shard_status reports in one transaction, in the order given.

    One query finds and locks every shard named (in id order, so concurrent
    batches cannot deadlock); each report then costs only the writes it makes.
    A report about a shard not on the reporting node is logged and ignored: a
    node speaks only for itself. A report that fails to apply is logged and
    undone alone (its savepoint); the others stand.
    """
    outbox = Outbox()
    wake = woken = False
    with transaction.atomic():
        shards = {
            shard.pk: shard
            for shard in Shard.objects.select_for_update()
            .select_related("replica__profile", "node")
            .filter(pk__in={status.shard_id for _, _, status in reports})
            .order_by("pk")
        }
        touched_replicas: set[int] = set()
        now = timezone.now()
        for node_id, node_name, status in reports:
            shard = shards.get(status.shard_id)
            if shard is not None and shard.replica_id in touched_replicas:
                # An earlier report of this batch may have changed the replica (failed it, published it):
                # read it again, as a report of its own would.
                shard = Shard.objects.select_related("replica__profile", "node").filter(pk=status.shard_id).first()
            if shard is None or shard.node_id != node_id:
                log.info(
                    "node %s reported shard %s as %s, but no such shard is on it; ignored",
                    node_name, status.shard_id, status.state,
                )  # fmt: skip
                continue
            touched_replicas.add(shard.replica_id)
            decided = len(outbox.commands)
            waking = status.state == "ready" and shard.replica.state == ReplicaState.WAKING
            try:
                with transaction.atomic():
                    applied = _apply_shard_status(
                        shard, status.state, status.message, status.port, now, outbox, port_busy=status.port_busy
                    )
                wake |= applied
                woken |= applied and waking
            except DatabaseError:
                del outbox.commands[decided:]  # what the undone report decided is not sent either
                log.exception("could not record node %s's report of shard %s as %s", node_name, shard.pk, status.state)
            if shard.pk is None:  # deleted (stopped): a later report of this batch finds no such shard
                shards.pop(status.shard_id, None)
        if wake:
            notify_work_pending()
        if woken:
            # A swap's requests are waiting for this replica: routers get it now, not after the next tick's work.
            transaction.on_commit(publish_endpoint_table)
        outbox.send_on_commit()


def reconcile_reported_shards_of_nodes(reports: Sequence[tuple[Node, list[RunningShard]]]) -> None:
    """Match what agents say they run (on hello) against the shard rows for their nodes.

    Known and reported: kept, with the reported state applied. Reported but
    unknown: stopped (orphans). Expected but not reported: the agent lost its
    engines, so their replicas fail and back off. The nodes' shards are read
    and locked in one query.
    """
    now = timezone.now()
    outbox = Outbox()
    wake = False
    with transaction.atomic(savepoint=False):
        expected: dict[int, dict[int, Shard]] = {node.pk: {} for node, _ in reports}
        shards = Shard.objects.select_for_update().select_related("replica__profile", "node")
        for shard in shards.filter(node_id__in=list(expected)).order_by("pk"):
            expected[shard.node_id][shard.pk] = shard
        touched_replicas: set[int] = set()
        for node, reported in reports:
            mine = expected[node.pk]
            if any(shard.replica_id in touched_replicas for shard in mine.values()):
                # A replica spanning nodes of this batch may have been changed by an earlier node's hello.
                mine = {shard.pk: shard for shard in shards.filter(node_id=node.pk)}
            touched_replicas |= {shard.replica_id for shard in mine.values()}
            wake |= _reconcile_node(node, reported, mine, now, outbox)
        if wake:
            notify_work_pending()
        outbox.send_on_commit()


def _reconcile_node(node: Node, reported: list[RunningShard], expected: dict[int, Shard], now, outbox: Outbox) -> bool:
    """Match one node's reported shards against its (locked) rows; return whether to wake the ticker."""
    wake = False
    reported_ids = set()
    for item in reported:
        reported_ids.add(item.shard_id)
        shard = expected.get(item.shard_id)
        if shard is None:
            outbox.stop(node.name, item.shard_id)
            continue
        # One shard per replica per node, so applying one report never deletes another expected shard.
        # An agent's own in-between states (newer agents may have more) change nothing here.
        if item.state in SHARD_REPORT_STATES:
            wake |= _apply_shard_status(shard, item.state, "", item.port, now, outbox)
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
        s.replica_id for s in missing if s.replica.state != ReplicaState.STOPPING and s.state != ShardState.ASSIGNED
    }
    if lost:
        # The agent restarted and lost its engines: the node's doing, so no backoff.
        fail_replicas(
            lost,
            f"agent on {node.name} no longer runs shard(s) "
            f"{', '.join(str(s.pk) for s in missing if s.replica_id in lost)}",
            now,
            outbox,
            node_fault=True,
            silent_shard_ids={s.pk for s in missing if s.replica_id in lost},
        )
        wake = True
    return wake


def stop_orphan_shards(node_id: int, node_name: str, reported: list[ShardHeartbeat]) -> int:
    """Stop engines an agent reports (in a heartbeat) whose shard rows no longer exist.

    Shard ids reach agents only after their rows commit, so an id the rows do
    not know was deleted (its replica failed or was removed with its profile or
    model): the engine is an orphan holding GPUs. One query. Returns how many
    stops were sent.
    """
    reported_ids = {item.shard_id for item in reported}
    if not reported_ids:
        return 0
    known = set(Shard.objects.filter(node_id=node_id, pk__in=reported_ids).values_list("pk", flat=True))
    orphans = sorted(reported_ids - known)
    if orphans:
        log.warning("node %s runs shard(s) %s that no replica owns; stopping them", node_name, orphans)
        outbox = Outbox()
        with transaction.atomic():
            for shard_id in orphans:
                outbox.stop(node_name, shard_id)
            outbox.send_on_commit()
    return len(orphans)


def record_running(node_id: int, reported: list[ShardHeartbeat]) -> int:
    """Store the requests in flight a heartbeat reports for each of the node's own shards; return rows changed.

    A shard of the node that the heartbeat does not mention, or mentions
    without a count, is unknown (null), never 0 (DESIGN invariant 3). Only
    rows whose value changed are written, so a steady fleet costs one read per
    heartbeat: one query, plus one bulk update when something changed.
    `updated_at` is left alone: it times start resends, not load.
    """
    running = {item.shard_id: item.running for item in reported}
    changed = []
    # order_by(): the default ordering would join the replicas for nothing.
    for shard in Shard.objects.filter(node_id=node_id).order_by().only("pk", "running"):
        now = running.get(shard.pk)
        if shard.running != now:
            shard.running = now
            changed.append(shard)
    if changed:
        Shard.objects.bulk_update(changed, ["running"], batch_size=len(changed))
    return len(changed)
