"""A worker's lease campaign, one round at a time, on the real database (the processes are in
test_celery_leadership.py): who campaigns, who consumes the leader queue, and what a broker outage does."""

from types import SimpleNamespace

import pytest
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.solo import TaskPool as SoloPool
from django.core.exceptions import ImproperlyConfigured

from conftest import wait_until
from reconciler.leadership.campaign import Campaign, LeaseCampaignStep
from reconciler.leadership.lease import Leadership
from reconciler.models import Lease

pytestmark = pytest.mark.django_db

QUEUE = "reconcile-leader"


class Consumer:
    """Stands in for Celery's worker consumer: what the campaign calls on it, run at once, and what it consumes."""

    def __init__(self):
        self.queues = {"celery"}
        self.task_consumer = self

    def call_soon(self, callback, *args):
        callback(*args)

    def consuming_from(self, queue):
        return queue in self.queues

    def add_task_queue(self, queue):
        self.queues.add(queue)

    def cancel_task_queue(self, queue):
        self.queues.discard(queue)


def campaign(ttl=10.0, grace=60.0):
    return Campaign(Leadership(name="lease-w", ttl=ttl), queue=QUEUE, period=1, broker_grace=grace)


def test_a_worker_that_never_reached_the_broker_does_not_campaign():
    worker = campaign()
    worker.campaign_once()
    assert not Lease.objects.filter(name="lease-w").exists()


def test_the_holder_consumes_the_leader_queue_and_the_others_do_not():
    workers = [campaign() for _ in range(3)]
    consumers = [Consumer() for _ in workers]
    for worker, consumer in zip(workers, consumers, strict=True):
        worker.broker_connected(consumer)
        worker.campaign_once()
    assert [w.leadership.held for w in workers] == [True, False, False]
    assert [QUEUE in c.queues for c in consumers] == [True, False, False]


def test_renewals_keep_the_epoch_and_the_new_leader_grace():
    worker = campaign()
    worker.broker_connected(Consumer())
    worker.campaign_once()
    since = worker.leadership.leader_since
    for _ in range(5):
        worker.campaign_once()
    assert (worker.leadership.epoch, worker.leadership.leader_since) == (1, since)


def test_a_worker_that_lost_the_lease_stops_consuming_the_leader_queue():
    worker, consumer = campaign(), Consumer()
    worker.broker_connected(consumer)
    worker.campaign_once()
    Lease.objects.filter(name="lease-w").update(expires_at=0)  # it paused past its lease…
    assert Leadership(name="lease-w", ttl=10).renew()  # …and another took over
    worker.campaign_once()
    assert worker.leadership.held is False
    assert QUEUE not in consumer.queues


def test_a_broker_blip_keeps_the_lease_and_a_long_outage_gives_it_up():
    worker, standby = campaign(grace=0.2), campaign()
    worker.broker_connected(Consumer())
    standby.broker_connected(Consumer())
    worker.campaign_once()

    worker.broker_lost()
    worker.campaign_once()  # within the grace: still renewing
    assert worker.leadership.held is True
    standby.campaign_once()
    assert standby.leadership.held is False

    wait_until(lambda: not worker.may_lead(), timeout=2)
    worker.campaign_once()  # cut off for longer: it could not receive ticks, so it lets go
    assert worker.leadership.held is False
    standby.campaign_once()
    assert (standby.leadership.held, standby.leadership.epoch) == (True, 2)


@pytest.mark.django_db(transaction=True)
def test_stopping_releases_the_lease_for_a_standby():
    """The campaign thread (on a connection of its own) releases the lease on its way out."""
    worker, standby = campaign(), campaign()
    for each in (worker, standby):
        each.broker_connected(Consumer())
        each.campaign_once()
    worker.start()
    worker.stop()
    standby.campaign_once()
    assert (standby.leadership.held, standby.leadership.epoch) == (True, 2)


def test_a_worker_with_a_process_pool_is_refused_at_start():
    with pytest.raises(ImproperlyConfigured, match="--pool solo"):
        LeaseCampaignStep(SimpleNamespace()).create(SimpleNamespace(pool_cls=PreforkPool))
    worker = SimpleNamespace(pool_cls=SoloPool)
    assert LeaseCampaignStep(worker).create(worker) is worker.lease_campaign
