"""Usage stamps moved into last use (DESIGN invariant 3: unknown is not idle)."""

from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from hub import get_hub
from reconciler.models import Replica
from tests.fleet import make_model, ready_replicas

pytestmark = pytest.mark.django_db


def test_usage_stamps_move_into_last_used_and_unknown_stays_unknown(run_tick):
    model = make_model("llama", min_replicas=2, max_replicas=2)
    run_tick()  # creates two (unplaceable) replicas
    used, unused = Replica.objects.order_by("id")
    stamp = datetime(2030, 1, 1, tzinfo=UTC)
    hub = get_hub()
    async_to_sync(hub.record_usage)({str(used.pk): stamp.timestamp(), "999999": stamp.timestamp()})

    result = run_tick()

    used.refresh_from_db()
    unused.refresh_from_db()
    assert used.last_used == stamp
    assert unused.last_used is None
    assert unused.idle().known is False
    assert (result.usage_updated, result.usage_forgotten) == (1, 1)
    assert "999999" not in hub.collect_usage()
    assert model.replicas.count() == 2


def test_a_replica_never_used_while_watched_is_idle_since_it_became_ready(run_tick):
    """DESIGN invariant 3: "never asked for" is known only if routers watched since it became ready."""
    model = make_model("llama", min_replicas=0, max_replicas=3, idle_timeout_seconds=600)
    hub = get_hub()
    async_to_sync(hub.keep_watching)(60)
    since = datetime.fromtimestamp(hub.watching_since(), tz=UTC)
    before_watch, after_watch, long_unused = ready_replicas(model, [None, None, None])
    Replica.objects.filter(pk=before_watch.pk).update(ready_at=since - timedelta(seconds=5))
    Replica.objects.filter(pk=after_watch.pk).update(ready_at=since + timedelta(seconds=1))

    result = run_tick(now=since + timedelta(seconds=2))

    assert result.usage_idle_since_ready == 1
    before_watch.refresh_from_db()
    after_watch.refresh_from_db()
    assert before_watch.last_used is None  # became ready before anyone watched: unknown
    assert after_watch.last_used == after_watch.ready_at
    assert long_unused.last_used is None  # never became ready (no ready_at)

    # Unused past the idle timeout, it is now stoppable like any known-idle replica.
    result = run_tick(now=since + timedelta(seconds=1200))
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
