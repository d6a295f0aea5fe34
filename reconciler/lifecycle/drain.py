"""Draining nodes, make-before-break: a replacement first, then the old replica is drained.

`drain_nodes` cordons the nodes and, for each serving (READY) replica with a
shard on them, creates a PENDING replacement of the same model and profile
and marks the old one `replaced_by` it, with a `drain_deadline`
(LLMGW_DRAIN_REPLACEMENT_WAIT_SECONDS). The old replica keeps serving; demand
and the placer count the replacement in its stead. Replicas not serving yet
are stopped at once, as there is nothing to keep up.

Each tick `drain_replaced` then drains (a normal stop: unpublish, let the
engine finish its requests or time out, stop) every replica being replaced
whose replacement is ready; at once, with a note saying so, when the placer
found no room for the replacement (which is withdrawn: demand places one the
usual way if the model still wants it), when the replacement is gone, or
when the deadline passed. A constant number of queries.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from inventory.models import Node
from reconciler.choices import ReplicaState
from reconciler.lifecycle.transitions import StopRequest, notify_work_pending, stop_replicas
from reconciler.models import Replica

log = logging.getLogger(__name__)

NODE_DRAINED = "node drained"


def drain_nodes(node_ids: Iterable[int]) -> tuple[int, int]:
    """Cordon the nodes; replace and then drain their serving replicas, stop the others now (see the module).

    Returns (nodes cordoned, replicas that will be stopped), in one transaction.
    """
    node_ids = list(node_ids)
    now = timezone.now()
    wait = settings.LLMGW_DRAIN_REPLACEMENT_WAIT_SECONDS
    with transaction.atomic():
        nodes = Node.objects.filter(pk__in=node_ids).update(schedulable=False)
        # By id, not a join with DISTINCT: PostgreSQL allows no FOR UPDATE with DISTINCT.
        on_nodes = Replica.objects.filter(shards__node_id__in=node_ids).values("pk")
        replicas = list(
            Replica.objects.select_for_update()
            .filter(pk__in=on_nodes)
            .exclude(state=ReplicaState.STOPPING)
            .order_by("pk")
        )
        serving = [r for r in replicas if r.state == ReplicaState.READY and r.drain_deadline is None and wait > 0]
        already = [r for r in replicas if r.drain_deadline is not None]
        at_once = [r for r in replicas if r not in serving and r not in already]
        if serving:
            replacements = Replica.objects.bulk_create(
                Replica(model_id=r.model_id, profile_id=r.profile_id, pools=r.pools) for r in serving
            )
            for old, new in zip(serving, replacements, strict=True):
                old.replaced_by = new
                old.drain_deadline = now + timedelta(seconds=wait)
                old.stop_reason = f"{NODE_DRAINED}: serving until replica {new.pk} is ready"
            Replica.objects.bulk_update(serving, ["replaced_by", "drain_deadline", "stop_reason"])
            log.info(
                "node drain: replicas %s serve until their replacements %s are ready",
                [r.pk for r in serving],
                [r.replaced_by_id for r in serving],
            )
        deleted, stopping = stop_replicas([StopRequest(r, NODE_DRAINED) for r in at_once], now)
        notify_work_pending()
    return nodes, deleted + stopping + len(serving) + len(already)


def drain_replaced(now: datetime, no_room: set[int]) -> int:
    """Drain replicas being replaced whose replacement is ready, cannot be placed, is gone or is late.

    `no_room`: replicas the placer found no room for this tick. Runs inside the
    tick's transaction; returns how many replicas started draining.
    """
    waiting = list(
        Replica.objects.filter(drain_deadline__isnull=False)
        .exclude(state=ReplicaState.STOPPING)
        .select_related("replaced_by")
        .only("id", "state", "drain_deadline", "replaced_by__id", "replaced_by__state", "replaced_by__placement_note")
    )
    requests: list[StopRequest] = []
    withdraw: list[int] = []
    for old in waiting:
        new = old.replaced_by
        if new is None:
            why = "its replacement is gone"
        elif old.state != ReplicaState.READY:
            why = f"it stopped serving ({old.state}) before replica {new.pk} was ready"
        elif new.state == ReplicaState.READY:
            why = f"replaced by replica {new.pk}"
        elif new.pk in no_room:
            why = f"no room for a replacement ({new.placement_note})"
            withdraw.append(new.pk)
        elif old.drain_deadline is not None and now >= old.drain_deadline:  # the query's filter: never None
            late = settings.LLMGW_DRAIN_REPLACEMENT_WAIT_SECONDS
            why = f"replica {new.pk} was not ready within {late:g} s"
        else:
            continue
        requests.append(StopRequest(old, f"{NODE_DRAINED}: {why}"))
        log.info("node drain: draining replica %s: %s", old.pk, why)
    if withdraw:
        # Demand places one the usual way if the model still wants it.
        Replica.objects.filter(pk__in=withdraw, state=ReplicaState.PENDING).delete()
    deleted, stopping = stop_replicas(requests, now)
    return deleted + stopping
