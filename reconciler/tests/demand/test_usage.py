"""Usage stamps moved into last use (DESIGN invariant 3: unknown is not idle)."""

import time
from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from hub import InProcessHub, get_hub
from hub.contracts import UsageReport
from reconciler.models import Replica
from tests.fleet import make_model, ready_replicas

pytestmark = pytest.mark.django_db


def test_usage_stamps_move_into_last_used_and_unknown_stays_unknown(run_tick):
    model = make_model("llama", min_replicas=2, max_replicas=2)
    run_tick()  # creates two (unplaceable) replicas
    used, unused = Replica.objects.order_by("id")
    stamp = datetime(2030, 1, 1, tzinfo=UTC)
    hub = get_hub()
    report = UsageReport(router="router-a", stamps={str(used.pk): stamp.timestamp(), "999999": stamp.timestamp()})
    async_to_sync(hub.report_usage)(report)

    result = run_tick()

    used.refresh_from_db()
    unused.refresh_from_db()
    assert used.last_used == stamp
    assert unused.last_used is None
    assert unused.idle().known is False
    assert (result.usage_updated, result.usage_forgotten) == (1, 1)
    assert "999999" not in hub.collect_usage().stamps
    assert model.replicas.count() == 2


class FakeClock:
    """Unix time that moves only when a test says so (starting at the real now)."""

    def __init__(self):
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def at(self, offset: float = 0.0) -> datetime:
        return datetime.fromtimestamp(self.now + offset, tz=UTC)


def test_a_replica_never_used_while_watched_is_idle_since_it_became_ready(run_tick):
    """DESIGN invariant 3: "never asked for" is known only if routers watched since it became ready."""
    model = make_model("llama", min_replicas=0, max_replicas=3, idle_timeout_seconds=600)
    clock = FakeClock()
    hub = InProcessHub(clock=clock)
    start = clock.now
    async_to_sync(hub.report_usage)(UsageReport(router="router-a", ttl=60))
    before_watch, after_watch, long_unused = ready_replicas(model, [None, None, None])
    Replica.objects.filter(pk=before_watch.pk).update(ready_at=clock.at(-5))
    Replica.objects.filter(pk=after_watch.pk).update(ready_at=clock.at(3))

    clock.now += 2
    first = run_tick(now=clock.at(), hub=hub)
    assert (first.usage_known, first.usage_idle_since_ready) == (False, 0)  # complete, not yet for a mark lifetime
    assert first.usage_unknown_reason.startswith("waiting 60 s")

    for step in (48, 12):  # renewed within its ttl: one unbroken watch
        clock.now += step
        async_to_sync(hub.report_usage)(UsageReport(router="router-a", ttl=60))
    result = run_tick(now=clock.at(), hub=hub)

    assert (result.usage_known, result.usage_unknown_reason) == (True, "")
    assert result.usage_idle_since_ready == 1
    before_watch.refresh_from_db()
    after_watch.refresh_from_db()
    assert before_watch.last_used is None  # became ready before the watch was complete: unknown
    assert after_watch.last_used == after_watch.ready_at
    assert long_unused.last_used is None  # never became ready (no ready_at)

    # Unused past the idle timeout while watched throughout, it is stoppable like any known-idle replica.
    while clock.now < start + 1200:
        clock.now += 50
        async_to_sync(hub.report_usage)(UsageReport(router="router-a", ttl=60))
    result = run_tick(now=clock.at(), hub=hub)
    assert result.usage_known is True
    assert result.replicas_idle_stopped == 1
    assert not Replica.objects.filter(pk=after_watch.pk).exists()


def test_without_a_watch_unused_replicas_stay_unknown(run_tick):
    model = make_model("llama", min_replicas=0, max_replicas=1, idle_timeout_seconds=60)
    (replica,) = ready_replicas(model, [None])
    Replica.objects.filter(pk=replica.pk).update(ready_at=timezone.now())

    assert run_tick().usage_idle_since_ready == 0
    replica.refresh_from_db()
    assert replica.last_used is None


def test_an_older_usage_stamp_never_moves_last_used_back(run_tick):
    make_model("llama")
    run_tick()
    replica = Replica.objects.get()
    newer = datetime(2030, 1, 1, tzinfo=UTC)
    Replica.objects.filter(pk=replica.pk).update(last_used=newer)
    get_hub()._stamps[str(replica.pk)] = (newer - timedelta(hours=1)).timestamp()

    assert run_tick().usage_updated == 0
    replica.refresh_from_db()
    assert replica.last_used == newer
