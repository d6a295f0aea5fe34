"""The leader's sweep of weights no profile uses: removed from the nodes' disks after a grace period
(DESIGN "Weights on disk").

Deleting a model or a profile sends remove_weights at once (reconciler.weights.removal);
this catches the rest: weights put on a node by hand, a model whose source was
edited, a removal the agent refused or lost. Every LLMGW_WEIGHTS_SWEEP_SECONDS
(the first that long after the leader's first tick, so the nodes have reported
their weights), inside the tick's fenced transaction:

* a Weights row in use (reconciler.weights.removal.in_use: a profile's, a LoRA
  adapter's or a running engine's weights key is its source or its path, or,
  for a path, one lies inside the other) has its `unused_since` cleared; one
  not in use gets it set, once;
* rows unused for LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS (and unchanged on disk as
  long: `seen_at`), with no remove_weights pending for them, get one, oldest
  first, at most LLMGW_WEIGHTS_SWEEP_BATCH a sweep. Their `unused_since` is set
  anew, so one that did not take (the agent refused it) is tried again a grace
  period later, not every sweep.

The commands are the tick's: stamped with its epoch, pending until acknowledged,
made due when their node says hello. The agent deletes only strictly inside its
weights root (nodewire/weights/disk.py). Eight queries at most, whatever the fleet's size (the Weights
rows are read whole: paths cannot be matched in SQL).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import CharField, Exists, OuterRef, Value
from django.db.models.functions import Concat

from inventory.models import Weights
from reconciler.leadership.lease import Leadership
from reconciler.models import PendingCommand
from reconciler.outbox import NODE_SHARD_ID, WEIGHTS_SUBJECT_PREFIX, Outbox
from reconciler.weights.removal import weights_in_use

log = logging.getLogger(__name__)


def sweep_due(leadership: Leadership, now: datetime) -> bool:
    """Whether this tick sweeps; a leader's first tick only sets when its first sweep is."""
    if leadership.next_weights_sweep is None:
        leadership.next_weights_sweep = now + timedelta(seconds=settings.LLMGW_WEIGHTS_SWEEP_SECONDS)
    return now >= leadership.next_weights_sweep


def swept(leadership: Leadership, now: datetime) -> None:
    """The sweep of the tick at `now` committed: the next one is an interval later."""
    leadership.next_weights_sweep = now + timedelta(seconds=settings.LLMGW_WEIGHTS_SWEEP_SECONDS)


def sweep_unused_weights(now: datetime, outbox: Outbox) -> int:
    """Mark the weights not in use, and queue remove_weights for those unused past the grace period; return how
    many were queued. At most eight queries (see the module docstring)."""
    rows = list(Weights.objects.values_list("pk", "source", "path", "unused_since"))
    used, unused = weights_in_use((pk, source, path) for pk, source, path, _ in rows)
    since = {pk: unused_since for pk, _, _, unused_since in rows}
    again = [pk for pk in used if since[pk] is not None]
    if again:
        Weights.objects.filter(pk__in=again).update(unused_since=None)
    newly = [pk for pk in unused if since[pk] is None]
    if newly:
        Weights.objects.filter(pk__in=newly).update(unused_since=now)
    # Every row with `unused_since` set is now unused.
    cutoff = now - timedelta(seconds=settings.LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS)
    pending = PendingCommand.objects.filter(
        node_name=OuterRef("node__name"),
        shard_id=NODE_SHARD_ID,
        subject=Concat(Value(WEIGHTS_SUBJECT_PREFIX), OuterRef("source"), output_field=CharField()),
    )
    due = list(
        Weights.objects.filter(unused_since__lte=cutoff, seen_at__lte=cutoff)
        .exclude(Exists(pending))
        .order_by("unused_since", "pk")
        .values_list("pk", "node__name", "source", "path")[: settings.LLMGW_WEIGHTS_SWEEP_BATCH]
    )
    if not due:
        return 0
    Weights.objects.filter(pk__in=[pk for pk, *_ in due]).update(unused_since=now)
    for _, node_name, source, path in due:
        outbox.remove_weights(node_name, source, path)
    log.info("weights sweep: sent %d remove_weights for weights unused past the grace period", len(due))
    return len(due)
