"""The per-request log: the routers' records of each request (hub.contracts.RequestRecord) stored in
`RequestRecord` rows, and rows older than LLMGW_REQUEST_RECORD_DAYS deleted.

Whoever takes the records from the hub stores them here (the tick's token usage step, or router-only mode's token
store), in a fixed number of queries: one read of the keys named, one INSERT per `BATCH` records. A record whose
key is unknown (deleted since) is kept without it. Pages and reports never read these rows: they read the hourly
TokenUsage rows; the log is for looking up what one key did, request by request.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from hub.contracts import RequestRecord as Record
from hub.contracts import TokenSource, UsageSource
from keys.models import ApiKey, RequestRecord

log = logging.getLogger(__name__)

BATCH = 1000


def keep_days() -> int:
    """How many days records are kept (0: none are made)."""
    return int(settings.LLMGW_REQUEST_RECORD_DAYS)


def store_records(records: list[Record]) -> int:
    """Add `records` as RequestRecord rows, in one transaction; returns how many."""
    if not records:
        return 0
    digests = {record.key for record in records}
    with transaction.atomic():
        known = {
            digest: (pk, team, user)
            for pk, digest, team, user in ApiKey.objects.filter(key_hash__in=digests).values_list(
                "pk", "key_hash", "team_id", "user_id"
            )
        }
        rows = []
        for record in records:
            key, team, user = known.get(record.key, (None, None, None))
            rows.append(
                RequestRecord(
                    at=datetime.fromtimestamp(record.at, UTC),
                    key_id=key,
                    team_id=team,
                    user_id=user,
                    model=record.model,
                    status=record.status,
                    prompt_tokens=record.prompt,
                    completion_tokens=record.completion,
                    spend_units=record.spend,
                    milliseconds=record.milliseconds,
                )
            )
        RequestRecord.objects.bulk_create(rows, batch_size=BATCH)
    return len(rows)


def forget_old_records(days: int, now: datetime | None = None) -> int:
    """Delete the rows older than `days`; how many."""
    cutoff = (now or timezone.now()) - timedelta(days=days)
    deleted, _ = RequestRecord.objects.filter(at__lt=cutoff).delete()
    return deleted


def record_requests(hub: UsageSource | TokenSource) -> int:
    """Take the routers' records from the hub and store them, then forget what is past its days; what the
    database refuses goes back to the hub. Nothing when records are not kept. Returns how many were stored."""
    days = keep_days()
    if days <= 0:
        return 0
    try:
        records = hub.take_records()
    except Exception as exc:  # the hub unreachable: they wait there for the next round
        log.warning("could not take request records from the hub: %s", exc)
        return 0
    try:
        stored = store_records(records)
        forget_old_records(days)
    except Exception as exc:
        log.warning("could not store %d request records, giving them back to the hub: %s", len(records), exc)
        hub.restore_records(records)
        return 0
    return stored
