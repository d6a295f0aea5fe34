"""GPU time: each replica's awake GPUs times the seconds the tick saw it hold them, split at hour boundaries,
counted from its placement or its last count, never for a gap nobody watched, in four queries whatever the fleet."""

from datetime import UTC, datetime, timedelta

import pytest

from keys.models import GpuHour, TeamGpuHour
from reconciler.demand.gpu_time import COUNT_SECONDS, MAX_GAP_SECONDS, count_gpu_time, gpu_count_due, hours_between
from reconciler.models import GPUAssignment, Replica
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db

H0 = datetime.fromtimestamp(1_800_000_000, tz=UTC)  # an hour's start


def placed(name, node, gpus, started):
    profile = make_model(name, gpus_per_node=len(gpus)).profiles.get()
    replica = make_replica(profile, placement=[(node, gpus)])
    Replica.objects.filter(pk=replica.pk).update(started_at=started)
    return replica


def seconds():
    return {(row.replica_id, row.model, row.hour): row.gpu_seconds for row in GpuHour.objects.all()}


def test_hours_between_cuts_at_each_hour():
    start = H0 - timedelta(seconds=10)
    assert hours_between(start, H0 + timedelta(hours=1, seconds=5)) == [
        (int(H0.timestamp()) - 3600, 10.0),
        (int(H0.timestamp()), 3600.0),
        (int(H0.timestamp()) + 3600, 5.0),
    ]
    assert hours_between(H0, H0) == []


def test_a_replica_is_counted_from_placement_then_from_its_last_count_across_an_hour():
    node = make_node("n1")
    two = placed("llama", node, [0, 1], started=H0 - timedelta(seconds=20))
    count_gpu_time(H0 - timedelta(seconds=5))
    count_gpu_time(H0 + timedelta(seconds=25))
    before = H0 - timedelta(hours=1)
    assert seconds() == {(two.pk, "llama", before): 2 * 20.0, (two.pk, "llama", H0): 2 * 25.0}


def test_asleep_a_replica_spends_nothing_and_wakes_counted_from_the_tick_that_saw_it_asleep():
    node = make_node("n1")
    sleeper = placed("qwen", node, [0], started=H0)
    GPUAssignment.objects.update(awake=False)
    count_gpu_time(H0 + timedelta(seconds=100))
    assert seconds() == {}
    GPUAssignment.objects.update(awake=True)
    count_gpu_time(H0 + timedelta(seconds=130))
    assert seconds() == {(sleeper.pk, "qwen", H0): 30.0}


def test_a_gap_nobody_watched_counts_only_up_to_the_limit():
    node = make_node("n1")
    replica = placed("llama", node, [0], started=H0)
    count_gpu_time(H0 + timedelta(hours=2))
    assert sum(seconds().values()) == MAX_GAP_SECONDS
    assert Replica.objects.get(pk=replica.pk).gpu_time_until == H0 + timedelta(hours=2)


@pytest.mark.parametrize("size", [2, 20])
def test_counting_runs_four_queries_whatever_the_fleet(size, django_assert_num_queries):
    node = make_node("n1", gpus=size)
    for i in range(size):
        placed(f"m{i}", node, [i], started=H0)
    TeamGpuHour.objects.create(hour=H0 - timedelta(hours=1), model="m0", idle=True, gpu_seconds=1)  # rolled up
    with django_assert_num_queries(4):  # and the hour that has nothing to roll up
        assert count_gpu_time(H0 + timedelta(seconds=10)) == size
    assert sum(seconds().values()) == 10.0 * size


def test_a_leader_counts_every_count_seconds_from_its_second_tick(leader):
    assert not gpu_count_due(leader, H0)  # the first tick sets when: the marks carry its predecessor's counts
    assert not gpu_count_due(leader, H0 + timedelta(seconds=COUNT_SECONDS - 1))
    assert gpu_count_due(leader, H0 + timedelta(seconds=COUNT_SECONDS))
