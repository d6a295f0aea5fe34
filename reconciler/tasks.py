"""Celery tasks of the reconciler: the beat-driven tick (distributed mode), thin over reconciler.tick.

Ticks are routed to the leader queue, which only the worker holding the lease
consumes (reconciler.leadership.campaign).
"""

import logging

from celery import shared_task

from reconciler.leadership.lease import get_leadership
from reconciler.tick import tick as run_tick

log = logging.getLogger(__name__)


@shared_task(name="reconciler.tasks.tick", ignore_result=True)
def tick() -> None:
    """Run one reconcile tick with this worker process's Leadership (the one its campaign holds).

    Errors are logged, not raised: beat must keep ticking, and the next tick
    starts from the rows again.
    """
    try:
        report = run_tick(leadership=get_leadership())
    except Exception:
        log.exception("reconcile tick failed")
        return
    if report.leader:
        log.debug("reconcile tick: %s", report)
