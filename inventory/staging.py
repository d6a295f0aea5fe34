"""What agents say of their stages (agent/weights/staging.py), recorded on `WeightsStage` rows.

A `staging_status` updates its row (one statement). A ready stage stays, and
counts its node as holding the weights (placement reads it), until those
weights leave the node: removed by remove_weights, or gone from its report.
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.db.models import Exists, OuterRef, QuerySet

from inventory.choices import StagingState
from inventory.models import Weights, WeightsStage
from nodewire.weights.staging_messages import StagingStatus

log = logging.getLogger(__name__)


def record_staging_status(node_id: int, status: StagingStatus, now: datetime) -> bool:
    """Apply one staging_status (a row is created for a stage the control plane did not ask for, e.g. before a
    restore); returns whether the stage finished (ready or failed) with it. One or two statements."""
    finished = status.state in (StagingState.READY, StagingState.FAILED)
    fields = {
        "revision": status.revision,
        "state": status.state,
        "bytes_done": status.bytes_done,
        "bytes_total": status.bytes_total,
        "bytes_per_second": status.bytes_per_second,
        "message": status.message,
        "updated_at": now,
        "finished_at": now if finished else None,
    }
    if not WeightsStage.objects.filter(node_id=node_id, source=status.source).update(**fields):
        WeightsStage.objects.create(node_id=node_id, source=status.source, asked_at=now, **fields)
    if status.state == StagingState.FAILED:
        log.warning("staging %s on node %s failed: %s", status.source, node_id, status.message)
    elif finished:
        log.info("staging %s on node %s: ready (%s)", status.source, node_id, status.message)
    return finished


def forget_stages_of(weights: QuerySet[Weights]) -> int:
    """Forget the stages of weights about to be deleted (removed, or gone from the node's report), so a stage
    that was ready no longer counts its node as holding them; one statement."""
    rows = WeightsStage.objects.filter(
        Exists(weights.filter(node_id=OuterRef("node_id"), source=OuterRef("source"))), state=StagingState.READY
    )
    deleted, _ = rows.delete()
    return deleted
