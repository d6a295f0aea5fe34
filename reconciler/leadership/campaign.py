"""A Celery worker's campaign for the lease: steady leadership whatever the number of workers (DESIGN invariant 1).

Every worker process campaigns from a thread of its own, every `period`
seconds, whichever tasks it is given: it takes the lease when it is free and
renews it while it holds it. Only the holder consumes the leader queue, where
beat sends the ticks, so a tick never lands on a worker that does not lead and
the leader never goes without ticks because another worker was free first.
The lease lives in the database: a broker outage shorter than `broker_grace`
(four TTLs) does not touch it. A worker cut off from the broker for longer
gives the lease up (it could not receive ticks), and a worker that has never
reached the broker does not campaign. At worker shutdown the lease is released, so a
standby takes over at its next campaign instead of after the TTL.

Ticks run in the worker's main thread (`--pool solo`): the campaign thread and
the tick share one Leadership, and two ticks of one leader never overlap.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery import bootsteps
from celery.concurrency.solo import TaskPool as SoloPool
from celery.signals import worker_shutdown
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from reconciler.leadership.lease import Leadership, get_leadership

log = logging.getLogger(__name__)


def campaign_period() -> float:
    """Seconds between campaigns: a third of the TTL, or the tick interval when shorter.

    A leader renews at least three times per TTL; a standby notices a lease released or
    expired within one tick interval.
    """
    return min(settings.LLMGW_LEASE_TTL_SECONDS / 3, settings.LLMGW_TICK_SECONDS)


class Campaign:
    """Take or renew the lease every `period` seconds from a thread; consume `queue` while leading."""

    def __init__(self, leadership: Leadership, queue: str, period: float, broker_grace: float):
        self.leadership = leadership
        self.queue = queue
        self.period = period
        self.broker_grace = broker_grace
        self._consumer: Any = None  # the worker's Consumer while it is connected to the broker
        self._broker_lost_at: float | None = None  # monotonic time it lost the broker; None: never had it
        self._wake = threading.Event()
        self._stopping = False
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lease-campaign", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop campaigning and release the lease (idempotent): a standby takes over at once."""
        if self._stopped:
            return
        self._stopped = self._stopping = True
        self._wake.set()
        if self._thread is None:
            self.leadership.release()
        else:  # the campaign thread releases on its way out, on its own connection
            self._thread.join(timeout=self.leadership.lock_timeout + 5)

    def broker_connected(self, consumer: Any) -> None:
        """The worker's consumer is connected (at start, and again after each broker outage)."""
        self._consumer, self._broker_lost_at = consumer, None
        self.consume_if_leading(consumer)
        self._wake.set()  # campaign now rather than at the next period

    def broker_lost(self) -> None:
        if self._consumer is not None:
            self._consumer, self._broker_lost_at = None, time.monotonic()

    def may_lead(self) -> bool:
        """Connected to the broker, or cut off for less than the grace: a broker blip does not move leadership."""
        if self._consumer is not None:
            return True
        return self._broker_lost_at is not None and time.monotonic() - self._broker_lost_at < self.broker_grace

    def campaign_once(self) -> None:
        """One round: take or renew the lease if this worker may lead, else give it up; then match the queue."""
        if self.may_lead():
            self.leadership.renew()
        elif self.leadership.held:
            log.warning("lease %s: cut off from the broker, giving the lease up", self.leadership.name)
            self.leadership.release()
        consumer = self._consumer
        if consumer is not None:
            consumer.call_soon(self.consume_if_leading, consumer)

    def consume_if_leading(self, consumer: Any) -> None:
        """In the consumer's thread: consume the leader queue exactly while the lease is held."""
        try:
            task_consumer = consumer.task_consumer
            if task_consumer is None:
                return
            consuming = task_consumer.consuming_from(self.queue)
            if self.leadership.held and not consuming:
                consumer.add_task_queue(self.queue)
            elif consuming and not self.leadership.held:
                consumer.cancel_task_queue(self.queue)
        except Exception:  # the next campaign round tries again
            log.exception("could not change consuming from %s", self.queue)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                connection.close_if_unusable_or_obsolete()  # this thread's own connection, as after a request
                try:
                    self.campaign_once()
                except Exception:  # a failed round is retried at the next one, never fatal
                    log.exception("lease campaign failed")
                self._wake.wait(self.period)
            self.leadership.release()
        finally:
            connection.close()


class LeaseCampaignStep(bootsteps.StartStopStep):
    """Worker bootstep: campaign for the worker's lifetime; release the lease when it stops."""

    label = "Lease campaign"

    def create(self, worker: Any) -> Campaign:
        if not (isinstance(worker.pool_cls, type) and issubclass(worker.pool_cls, SoloPool)):
            raise ImproperlyConfigured(
                "the reconcile worker runs ticks one at a time in its main process: start it with --pool solo"
            )
        worker.lease_campaign = Campaign(
            get_leadership(),
            queue=settings.LLMGW_LEADER_QUEUE,
            period=campaign_period(),
            broker_grace=4 * settings.LLMGW_LEASE_TTL_SECONDS,
        )
        return worker.lease_campaign


class LeaderQueueStep(bootsteps.StartStopStep):
    """Consumer bootstep: tells the campaign when the consumer is connected to the broker, and when not."""

    label = "Leader queue"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, consumer: Any) -> None:
        campaign = getattr(consumer.controller, "lease_campaign", None)
        if campaign is not None:
            campaign.broker_connected(consumer)

    def stop(self, consumer: Any) -> None:
        campaign = getattr(consumer.controller, "lease_campaign", None)
        if campaign is not None:
            campaign.broker_lost()

    shutdown = stop


@worker_shutdown.connect
def release_lease_at_worker_shutdown(sender: Any = None, **kwargs: Any) -> None:
    """Also at a shutdown that did not stop the bootsteps (the worker was still starting)."""
    campaign = getattr(sender, "lease_campaign", None)
    if campaign is not None:
        campaign.stop()
