"""Last use, moved from the hub's usage stamps into Replica.last_used once a tick (DESIGN invariants 3 and 4)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from django.db.models import F

from .models import Replica

log = logging.getLogger(__name__)


def collect_usage(stamps: dict[str, float]) -> tuple[int, list[str]]:
    """Move newer usage stamps into Replica.last_used.

    Returns (replicas updated, stamp keys to forget: malformed or of replicas
    that no longer exist). Two queries whatever the number of stamps.
    """
    if not stamps:
        return 0, []
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
    return len(changed), forget


def mark_unused_since_ready(watching_since: float | None) -> int:
    """Replicas that became ready while routers were watching, and have no stamp, are idle since ready.

    DESIGN invariant 3: only then is "never used" a fact; a replica that became
    ready before the current watch began keeps an unknown last use. One query.
    """
    if watching_since is None:
        return 0
    since = datetime.fromtimestamp(watching_since, tz=UTC)
    return Replica.objects.ready().filter(last_used__isnull=True, ready_at__gte=since).update(last_used=F("ready_at"))
