"""Usage as the tick reads it (DESIGN invariants 3 and 4): whether idleness is known, and last use.

`assess_usage` judges the routers' watch marks: idleness is known only while
usage was collected and every live router kept its mark, without a break, for
at least the longest mark lifetime. `collect_usage` moves the stamps into
Replica.last_used; `mark_unused_since_ready` turns "never used while watched"
into "idle since ready".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime

from django.conf import settings
from django.db.models import F

from hub.contracts import ADAPTER_STAMP_SEPARATOR, ModelWindow, RouterMark, UsageSnapshot
from hub.windows import merged
from reconciler.models import Replica, UsageWatch

log = logging.getLogger(__name__)


def collect_usage(stamps: dict[str, float]) -> tuple[int, list[str]]:
    """Move newer usage stamps into Replica.last_used.

    Returns (replicas updated, stamp keys to forget: malformed, of replicas
    that no longer exist, or an adapter's, which reconciler.adapters records).
    Two queries whatever the number of stamps.
    """
    if not stamps:
        return 0, []
    known = dict(Replica.objects.values_list("id", "last_used"))
    changed, forget = [], []
    for key, ts in stamps.items():
        if ADAPTER_STAMP_SEPARATOR in key:
            forget.append(key)  # an adapter's last use on a replica: reconciler.adapters records it
            continue
        try:
            replica_id = int(key)
            stamp = datetime.fromtimestamp(float(ts), tz=UTC)
        except (TypeError, ValueError, OverflowError, OSError):
            log.warning("ignoring malformed usage stamp %r=%r", key, ts)
            forget.append(key)
            continue
        if replica_id not in known:
            forget.append(key)
        elif (last := known[replica_id]) is None or stamp > last:
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


FLEET = "fleet"  # the one UsageWatch row


@dataclass(frozen=True)
class UsageVerdict:
    """What this tick may believe about usage.

    `known` False means idleness is unknown (DESIGN invariant 3): nothing is
    stopped for idleness or evicted, and `reason` says why. `watching_since`
    (Unix time, None when unknown) is when the current unbroken watch began,
    for `mark_unused_since_ready`. `in_flight` sums live routers' peaks per
    public model, and `windows` their windows (hub.windows); `gone` lists routers
    silent past LLMGW_ROUTER_FORGET_SECONDS, whose marks the tick drops after commit.
    """

    known: bool
    reason: str
    watching_since: float | None = None
    in_flight: dict[str, int] = field(default_factory=dict)
    gone: list[str] = field(default_factory=list)
    windows: dict[str, ModelWindow] = field(default_factory=dict)


def assess_usage(snapshot: UsageSnapshot | None, error: str, now: datetime) -> UsageVerdict:
    """Judge this tick's usage snapshot (None: collection failed with `error`) and record it in UsageWatch.

    Unknown when collection failed, when a router's mark has lapsed (for less
    than the forget window), or when no router reports. Otherwise usage is
    complete now, and known once it has been complete for the longest live
    mark's ttl: a router back from an outage has flushed what it held by then.
    One read and at most one write.
    """
    at = now.timestamp()
    watch = UsageWatch.objects.filter(name=FLEET).first()
    live: list[RouterMark] = []
    gone: list[str] = []
    silent: list[RouterMark] = []
    if snapshot is None:
        reason = f"could not collect usage: {error or 'unknown error'}"
    else:
        for mark in snapshot.routers:
            if not mark.lapsed(at):
                live.append(mark)
            elif at - mark.renewed > settings.LLMGW_ROUTER_FORGET_SECONDS:
                gone.append(mark.router)
            else:
                silent.append(mark)
        reason = _incomplete_reason(silent, live, at)

    in_flight: dict[str, int] = {}
    by_model: dict[str, list[ModelWindow]] = {}
    for mark in live:
        for model, count in mark.in_flight.items():
            in_flight[model] = in_flight.get(model, 0) + count
        for model, window in mark.windows.items():
            by_model.setdefault(model, []).append(window)
    windows = {model: merged(found) for model, found in by_model.items()}

    complete_since: datetime | None = None
    if not reason:
        # Complete now: since when without a break (a row with a reason was a break).
        complete_since = watch.known_since if watch is not None and watch.known_since else now
        grace = max(mark.ttl for mark in live)
        waited = at - complete_since.timestamp()
        if waited < grace:
            reason = f"waiting {grace:g} s after usage became complete for routers to flush what they held"
    _record(watch, complete_since, reason, now)
    if reason:
        return UsageVerdict(False, reason, None, in_flight, gone, windows)
    assert complete_since is not None
    newest = max(mark.since for mark in live)
    return UsageVerdict(True, "", max(complete_since.timestamp(), newest), in_flight, gone, windows)


def _incomplete_reason(silent: list[RouterMark], live: list[RouterMark], at: float) -> str:
    """Why usage is incomplete now, or "" when every router we know of is reporting."""
    if silent:
        worst = min(silent, key=lambda mark: mark.renewed)
        others = f" (and {len(silent) - 1} more)" if len(silent) > 1 else ""
        return f"router {worst.router} has not reported usage for {at - worst.renewed:.0f} s{others}"
    if not live:
        return "no router is reporting usage"
    return ""


def _record(watch: UsageWatch | None, complete_since: datetime | None, reason: str, now: datetime) -> None:
    """Keep the fleet row: `known_since` is when usage became complete (None while incomplete)."""
    if watch is None:
        UsageWatch.objects.create(name=FLEET, known_since=complete_since, reason=reason)
    elif (watch.known_since, watch.reason) != (complete_since, reason):
        UsageWatch.objects.filter(name=FLEET).update(known_since=complete_since, reason=reason, updated_at=now)
