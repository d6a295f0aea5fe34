"""A heartbeat is one transaction with a fixed number of queries, however many shards the node runs;
a steady one writes nothing, and `last_seen` is written for many nodes in one statement."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from agentlink.services import on_heartbeat
from inventory.models import Node
from inventory.services import mark_nodes_seen
from nodewire.parts import GPUHealth, ShardHeartbeat
from nodewire.protocol import Heartbeat
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
    # The heartbeat's savepoint in and out, node alive, GPU health read, running read + write, orphan check.
    with django_assert_num_queries(7):
        on_heartbeat(node.pk, node.name, heartbeat(shards, running=1))
    with django_assert_num_queries(6):
        on_heartbeat(node.pk, node.name, heartbeat(shards, running=1))  # nothing changed: no write
    assert set(Shard.objects.values_list("running", flat=True)) == {1}


def test_a_steady_heartbeat_writes_nothing_and_last_seen_is_one_update_for_a_whole_batch(
    django_assert_num_queries,
):
    nodes = [make_node(f"gpu-{i}", gpus=8) for i in range(50)]
    node = nodes[0]
    profile = make_model("m").profiles.get()
    shards = [make_replica(profile, placement=[(node, [0])]).shards.get()]
    on_heartbeat(node.pk, node.name, heartbeat(shards, running=1), mark_seen=False)
    with CaptureQueriesContext(connection) as steady:
        on_heartbeat(node.pk, node.name, heartbeat(shards, running=1), mark_seen=False)
    # The savepoint in and out, GPU health read, running read, orphan check: reads only.
    assert len(steady) == 5
    assert not [q["sql"] for q in steady if q["sql"].lstrip().upper().startswith(("UPDATE", "INSERT", "DELETE"))]

    seen_at = timezone.now()
    with django_assert_num_queries(1):
        assert mark_nodes_seen([n.pk for n in nodes], seen_at) == 50
    assert set(Node.objects.values_list("last_seen", flat=True)) == {seen_at}
