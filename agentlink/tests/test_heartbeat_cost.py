"""A heartbeat is one transaction with a fixed number of queries, however many shards the node runs."""

import pytest

from agent.protocol import GPUHealth, Heartbeat, ShardHeartbeat
from agentlink.services import on_heartbeat
from reconciler.models import Shard
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


def heartbeat(shards, running) -> Heartbeat:
    return Heartbeat(
        gpus=[GPUHealth(index=i, healthy=True) for i in range(8)],
        shards=[ShardHeartbeat(shard_id=s.pk, state="ready", running=running) for s in shards],
    )


@pytest.mark.parametrize("replicas", [1, 8])
def test_a_heartbeat_costs_the_same_queries_for_one_shard_or_eight(replicas, django_assert_num_queries):
    node = make_node("gpu-a", gpus=8)
    profile = make_model("m", max_replicas=8).profiles.get()
    shards = [make_replica(profile, placement=[(node, [i])]).shards.get() for i in range(replicas)]
    # Two savepoints in and out (the heartbeat's, the GPU health's), node alive, GPU health read,
    # running read + write, orphan check.
    with django_assert_num_queries(9):
        on_heartbeat(node.pk, node.name, heartbeat(shards, running=1))
    with django_assert_num_queries(8):
        on_heartbeat(node.pk, node.name, heartbeat(shards, running=1))  # nothing changed: no write
    assert set(Shard.objects.values_list("running", flat=True)) == {1}
