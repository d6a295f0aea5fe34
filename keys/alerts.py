"""Soft limits: one alert per budget and window once its spend and reservations reach the budget's
`soft_limit_percent`, POSTed as JSON to its `alert_url`.

The reconcile tick calls `check_budget_alerts` every `CHECK_SECONDS` (outside its fenced transaction): one query for the budgets with a
soft limit, one hub round trip for their counters (keys.budget_use), one query for the alerts already made.
An alert is a `BudgetAlert` row whose counter (the budget's window) is unique, so a window is alerted once
whoever checks; its delivery is tried at once and, when the endpoint fails, again on later ticks every
`RETRY_SECONDS`, `ATTEMPTS` times in all. A budget without an alert URL has its alert logged only.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

import httpx
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from hub.contracts import BudgetReader
from keys.budget_use import current_use
from keys.models import Budget, BudgetAlert

log = logging.getLogger(__name__)

ATTEMPTS = 5
RETRY_SECONDS = 60
TIMEOUT_SECONDS = 2.0  # an alert endpoint that hangs must not hold the tick


def check_budget_alerts(hub: BudgetReader, now: datetime | None = None) -> int:
    """Make the alerts of budgets whose soft limit was reached in their window, and deliver what is due; how many
    were delivered. Never raises: a failing check is logged and tried again on the next tick."""
    at = now or timezone.now()
    try:
        made = _make_alerts(hub, at)
        return _deliver_due(at, made)
    except Exception:
        log.exception("could not check budgets' soft limits")
        return 0


def _make_alerts(hub: BudgetReader, now: datetime) -> list[BudgetAlert] | None:
    """The alerts made now; None when no budget has a soft limit (then nothing is due again either: a tick of a
    fleet without soft limits pays one query)."""
    budgets = list(Budget.objects.filter(soft_limit_percent__isnull=False).select_related("team", "user", "key"))
    if not budgets:
        return None
    due = [use for use in current_use(budgets, hub, now) if use.reached(use.budget.soft_limit_percent or 100)]
    if not due:
        return []
    known = set(BudgetAlert.objects.filter(counter__in=[use.counter for use in due]).values_list("counter", flat=True))
    made = []
    for use in due:
        if use.counter in known:
            continue
        try:
            with transaction.atomic():
                made.append(
                    BudgetAlert.objects.create(
                        budget=use.budget, counter=use.counter, window_start=use.start, used_units=use.used
                    )
                )
        except IntegrityError:  # made meanwhile by another control plane: alerted once all the same
            continue
    return made


def _deliver_due(now: datetime, made: list[BudgetAlert] | None) -> int:
    if made is None:
        return 0
    retry = now - timedelta(seconds=RETRY_SECONDS)
    pending = list(
        BudgetAlert.objects.filter(delivered_at=None, attempts__lt=ATTEMPTS)
        .filter(Q(last_attempt_at=None) | Q(last_attempt_at__lte=retry))
        .exclude(pk__in=[alert.pk for alert in made])
        .select_related("budget__team", "budget__user", "budget__key")
    )
    delivered = 0
    for alert in [*made, *pending]:
        delivered += _deliver(alert, now)
    return delivered


def payload(alert: BudgetAlert) -> dict[str, object]:
    """The JSON an alert endpoint receives."""
    budget = alert.budget
    return {
        "type": "budget.soft_limit",
        "budget": budget.pk,
        "scope": budget.scope_text(),
        "team": budget.team.name if budget.team is not None else None,
        "window": budget.window,
        "timezone": budget.timezone,
        "window_start": alert.window_start.isoformat() if alert.window_start is not None else None,
        "amount": f"{budget.amount:f}",
        "used": f"{alert.used_units / 10**12:.6f}",
        "soft_limit_percent": budget.soft_limit_percent,
    }


def _deliver(alert: BudgetAlert, now: datetime) -> int:
    budget = alert.budget
    body = payload(alert)
    log.warning(
        "budget %s reached %s%% of %s in its window: %s used or reserved",
        budget.scope_text(),
        budget.soft_limit_percent,
        body["amount"],
        body["used"],
    )
    alert.attempts += 1
    alert.last_attempt_at = now
    if not budget.alert_url:
        alert.delivered_at, alert.last_error = now, ""
    else:
        try:
            reply = httpx.post(budget.alert_url, json=body, timeout=TIMEOUT_SECONDS, follow_redirects=False)
            reply.raise_for_status()
            alert.delivered_at, alert.last_error = now, ""
        except httpx.HTTPError as exc:
            alert.last_error = f"{type(exc).__name__}: {exc}"[:1000]
            log.warning(
                "budget alert %s not delivered to %s (attempt %d): %s", alert.pk, budget.alert_url, alert.attempts, exc
            )
    alert.save(update_fields=["attempts", "last_attempt_at", "delivered_at", "last_error"])
    return int(alert.delivered_at is not None and bool(budget.alert_url))
