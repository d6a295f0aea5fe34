"""A tick runs a constant number of queries whatever the fleet size."""

import pytest
from asgiref.sync import async_to_sync
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from catalog.models import Model
from hub import get_hub
from inventory.models import Node
from reconciler.choices import ReplicaState
from reconciler.models import PendingCommand, Replica, UsageWatch
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


def fleet(size):
    for i in range(size):
        make_node(f"gpu-{i:02d}", gpus=2, fabric="ib-a")
        make_model(f"model-{i:02d}", gpus_per_node=2)
    make_model("pair", gpus_per_node=2, nodes_per_replica=2, min_replicas=0)


def tick_queries(run_tick, now=None):
    with CaptureQueriesContext(connection) as queries:
        run_tick(now=now)
    return len(queries)


def test_a_tick_runs_the_same_number_of_queries_for_2_and_20_nodes(run_tick, django_assert_max_num_queries):
    counts = {}
    for size in (2, 20):
        Replica.objects.all().delete()
        Model.objects.all().delete()
        Node.objects.all().delete()
        UsageWatch.objects.all().delete()  # both sizes start with no verdict recorded
        PendingCommand.objects.all().delete()  # nor with the other size's commands due to be sent again
        fleet(size)
        async_to_sync(get_hub().request_activation)("pair")
        # Both ticks at one instant: on a loaded machine the bigger fleet's ticks can be more than
        # LLMGW_COMMAND_RESEND_SECONDS apart by the wall clock, and the steady tick would then send the
        # starts again, one query more for that size only.
        now = timezone.now()
        placing = tick_queries(run_tick, now)
        assert Replica.objects.filter(state=ReplicaState.STARTING).count() == size
        steady = tick_queries(run_tick, now)
        # The unplaceable pair is looked at for eviction every tick, even while idleness is unknown (to hold its
        # requests if eviction would make room once it is known): occupants, spares and draining GPUs; and
        # LoRA adapters: the asked names among them, the fleet's loads tended, the table's adapters; and the stages
        # of the pending replicas' weights (reconciler.weights.staging).
        with django_assert_max_num_queries(36):
            run_tick()
        counts[size] = (placing, steady)
    assert counts[2] == counts[20]


@pytest.mark.usefixtures("usage_known")
@pytest.mark.parametrize("size", [2, 20])
def test_a_steady_tick_over_a_served_fleet_skips_the_steps_with_nothing_to_do(run_tick, size):
    """Every replica ready and used, nothing failed, stopping, sleeping or waiting for a replacement: demand's
    census skips retries, forgiving, placement, replaced drains, stops and sleeps (a query each, or two)."""
    for i in range(size):
        node = make_node(f"gpu-{i:02d}", gpus=2, fabric="ib-a")
        make_replica(
            make_model(f"model-{i:02d}", gpus_per_node=2).profiles.get(),
            placement=[(node, [0, 1])],
            last_used=timezone.now(),
        )
    run_tick()

    # The lease renewed (1) in a transaction of its own, the budgets with a soft limit (1: none here), then in
    # the tick's: usage (2), liveness (2: the silent nodes, the shards to fail), demand (3), resend starts, the
    # stop/sleep check, adapter loads, resend unacknowledged, the fence (5), and the endpoint table (5) after
    # commit. Each transaction adds two (begin and end; savepoints here), and on PostgreSQL a third: its lock
    # waits bounded.
    expected = 25 if connection.vendor == "postgresql" else 23
    assert tick_queries(run_tick) == expected
