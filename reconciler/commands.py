"""Commands the agents have not acknowledged: sent again by the tick, forgotten when answered.

reconciler.outbox records every command as a PendingCommand when it is
decided. The agent answers each with `ack` as soon as it has it (refused or
not); `acknowledge` (or `acknowledge_many`, for a batch) deletes the row. The
leader's tick sends again the oldest due ones, at most LLMGW_COMMAND_RESEND_BATCH
a tick, in two queries whatever their number: a message the channel layer dropped costs about
LLMGW_COMMAND_RESEND_SECONDS (plus up to a tick), and a dropped burst is re-sent
spread by the jitter, not as one burst.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime

from django.conf import settings
from django.db import transaction

from reconciler.models import PendingCommand
from reconciler.outbox import deliver, resend_due

log = logging.getLogger(__name__)


def resend_unacknowledged(now: datetime) -> int:
    """Send again (after commit) the oldest unacknowledged commands that are due; return how many.

    Two queries, whatever the number: the due rows (bounded) and one update of
    their next due time. A command is re-sent as it was first sent (same cid,
    same epoch): a new leader's agents refuse an old leader's command, and
    acknowledge the refusal, which ends its resending.
    """
    due = list(
        PendingCommand.objects.filter(due_at__lte=now)
        .order_by("due_at")
        .only("pk", "node_name", "payload", "attempts")[: settings.LLMGW_COMMAND_RESEND_BATCH]
    )
    if not due:
        return 0
    for row in due:
        row.attempts += 1
        row.due_at = resend_due(now, row.attempts)
    PendingCommand.objects.bulk_update(due, ["attempts", "due_at"], batch_size=len(due))
    commands = [(row.node_name, row.payload) for row in due]
    transaction.on_commit(lambda: deliver(commands))
    return len(due)


def acknowledge(node_name: str, cid: str, refused: bool = False, message: str = "") -> bool:
    """The agent of `node_name` has command `cid`: stop sending it. One query; returns whether it was pending.

    An ack for a command already superseded or acknowledged changes nothing.
    """
    if refused:
        log.warning("node %s refused command %s: %s", node_name, cid, message or "no reason given")
    deleted, _ = PendingCommand.objects.filter(node_name=node_name, cid=cid).delete()
    return bool(deleted)


def acknowledge_many(acks) -> int:
    """Stop sending the commands of (node name, cid) pairs; two queries whatever their number.

    Returns how many were still pending. A refused ack is logged by the caller as it comes.
    A command is settled only by its own node's ack: ids are looked up, then
    the rows whose node matches are deleted (flat IN lists: an OR of a term per
    node took a burst's worth of Python to compile, holding the event loop's GIL).
    """
    answered = set(acks)
    if not answered:
        return 0
    rows = PendingCommand.objects.filter(cid__in=[cid for _, cid in answered]).values_list("pk", "node_name", "cid")
    mine = [pk for pk, node_name, cid in rows if (node_name, cid) in answered]
    if not mine:
        return 0
    deleted, _ = PendingCommand.objects.filter(pk__in=mine).delete()
    return deleted


def send_pending_soon_to(node_names: Iterable[str], now: datetime) -> int:
    """Make the nodes' unacknowledged commands due now (their agents have just said hello); one query."""
    return PendingCommand.objects.filter(node_name__in=list(node_names), due_at__gt=now).update(due_at=now)
