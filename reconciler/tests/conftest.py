"""Fixtures of the reconciler tests: a leader, its tick, an agent's inbox, and shard reports."""

import asyncio
from contextlib import contextmanager
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.utils import timezone

from hub import UsageReport, get_hub
from llmgw_site.celery import app as celery_app
from nodewire.protocol import ShardStatus
from reconciler.agent_reports import record_shard_statuses
from reconciler.leadership.lease import Leadership
from reconciler.tick import tick
from tests.fleet import watch_usage


@contextmanager
def celery_broker(url):
    """Point the Celery app's producers at the broker `url` (a real Redis), and back afterwards."""

    def forget_connections():
        # Pools made for the old broker must not be reused.
        celery_app._pool = None
        celery_app.amqp._producer_pool = None

    saved = {key: celery_app.conf[key] for key in ("broker_url", "task_always_eager")}
    celery_app.conf.update(broker_url=url, task_always_eager=False)
    forget_connections()
    try:
        yield url
    finally:
        celery_app.conf.update(saved)
        forget_connections()


@pytest.fixture
def redis_broker(redis_url):
    """The Celery app's broker is the real Redis for one test."""
    with celery_broker(redis_url):
        yield redis_url


@pytest.fixture
def leader():
    """This test's leader, holding the lease since long enough to declare nodes lost."""
    leadership = Leadership(ttl=60)
    assert leadership.renew()
    leadership.leader_since = timezone.now() - timedelta(days=1)
    return leadership


@pytest.fixture
def run_tick(leader, django_capture_on_commit_callbacks):
    """Tick as the leader (on the process hub unless given one) and run what it sends after commit."""

    def run(now=None, hub=None):
        with django_capture_on_commit_callbacks(execute=True):
            return tick(leadership=leader, hub=hub or get_hub(), now=now)

    return run


@pytest.fixture
def agent_inbox():
    """Join a node's group on the real in-memory channel layer; return a function draining its commands
    (each checked to carry a `cid`, which is then left out)."""
    layer = get_channel_layer()

    def join(node_name):
        channel = async_to_sync(layer.new_channel)()
        async_to_sync(layer.group_add)(f"node.{node_name}", channel)

        async def drain():
            commands = []
            while True:
                try:
                    message = await asyncio.wait_for(layer.receive(channel), 0.05)
                except TimeoutError:
                    return commands
                command = dict(message["command"])
                # Every command carries an id for its ack; the tests compare what was decided.
                assert isinstance(command.pop("cid", None), str), f"command without a cid: {command}"
                commands.append(command)

        return async_to_sync(drain)

    return join


@pytest.fixture
def shard_report(django_capture_on_commit_callbacks):
    """Apply an agent's shard_status report and run what it sends after commit."""

    def report(node, shard, state, message="", port=None, port_busy=False):
        status = ShardStatus(shard_id=shard.pk, state=state, message=message, port=port, port_busy=port_busy)
        with django_capture_on_commit_callbacks(execute=True):
            record_shard_statuses([(node.pk, node.name, status)])

    return report


@pytest.fixture
def usage_known():
    """Usage is known to the tick: one router reports (a long-lived mark) and has done so for an hour."""
    async_to_sync(get_hub().report_usage)(UsageReport(router="test-router", ttl=3600))
    watch_usage(known_since=timezone.now() - timedelta(hours=1))
