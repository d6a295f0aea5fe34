"""The endpoint table names replicas leaving service whose engines still finish what they hold, with the time
routers move the streams they still relay (reconciler.endpoints._moving, router.forwarding.moves)."""

from datetime import timedelta

import pytest
from django.utils import timezone

from reconciler.choices import ReplicaState, ShardState
from reconciler.endpoints import MOVE_LEAD_SECONDS, build_endpoint_table
from reconciler.lifecycle.transitions import stop_replica
from reconciler.models import Replica, Shard
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


def ready_replica(name: str, node, gpu: int = 0):
    return make_replica(make_model(name).profiles.get(), placement=[(node, [gpu])], endpoint="http://127.0.0.1:21001")


def test_a_stopping_replica_is_moved_the_lead_before_its_drain_would_time_out(settings):
    settings.LLMGW_DRAIN_TIMEOUT_SECONDS = 60
    replica = ready_replica("llama", make_node("gpu-a"))
    assert build_endpoint_table().moving == {}

    stop_replica(replica)
    replica.refresh_from_db()
    table = build_endpoint_table()
    assert table.endpoints == []  # unpublished at once
    assert table.moving == {str(replica.pk): round(replica.stopping_since.timestamp() + 60 - MOVE_LEAD_SECONDS, 3)}

    # Its engine stopped: nothing is left to move.
    Shard.objects.filter(replica=replica).update(state=ShardState.STOPPED)
    assert build_endpoint_table().moving == {}


def test_a_drain_shorter_than_the_lead_moves_at_once(settings):
    settings.LLMGW_DRAIN_TIMEOUT_SECONDS = 0.5
    replica = ready_replica("llama", make_node("gpu-a"))
    stop_replica(replica)
    replica.refresh_from_db()
    assert build_endpoint_table().moving == {str(replica.pk): round(replica.stopping_since.timestamp(), 3)}


def test_a_replica_going_to_sleep_is_moved_until_its_engine_is_asleep(settings):
    settings.LLMGW_DRAIN_TIMEOUT_SECONDS = 30
    replica = ready_replica("sleepy", make_node("gpu-a"))
    since = timezone.now() - timedelta(seconds=5)
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.SLEEPING, endpoint_url="", sleeping_since=since)
    assert build_endpoint_table().moving == {str(replica.pk): round(since.timestamp() + 30 - MOVE_LEAD_SECONDS, 3)}

    Shard.objects.filter(replica=replica).update(state=ShardState.FALLING_ASLEEP)  # the sleep was sent
    assert str(replica.pk) in build_endpoint_table().moving
    Shard.objects.filter(replica=replica).update(state=ShardState.SLEEPING)
    assert build_endpoint_table().moving == {}


def test_serving_and_failed_replicas_are_never_moved(settings):
    node = make_node("gpu-a", gpus=2)
    ready_replica("serving", node)
    failed = ready_replica("failed", node, gpu=1)
    stop_replica(failed)
    Shard.objects.filter(replica=failed).update(state=ShardState.FAILED)  # its engine exited: nothing runs on it
    assert build_endpoint_table().moving == {}
