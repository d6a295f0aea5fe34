"""Leadership inside the tick: non-leaders do nothing, a paused leader commits nothing."""

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings

from hub import get_hub
from reconciler.leadership.lease import Leadership, try_acquire
from reconciler.models import Replica
from reconciler.outbox import current_epoch
from reconciler.tick import tick
from tests.fleet import make_model, make_node

pytestmark = pytest.mark.django_db


def test_a_non_leader_tick_does_nothing(django_capture_on_commit_callbacks):
    make_node("gpu-a")
    make_model("llama")
    try_acquire(settings.LLMGW_LEASE_NAME, "someone-else", 60)

    with django_capture_on_commit_callbacks(execute=True):
        result = tick(leadership=Leadership(ttl=60))

    assert result.leader is False
    assert Replica.objects.count() == 0
    assert async_to_sync(get_hub().read_endpoints)() is None


class PausedLeadership(Leadership):
    """A leader whose last renew succeeded before it paused past its lease: it still believes it leads."""

    def renew(self):
        return self.held


def test_a_leader_that_paused_past_its_lease_commits_nothing(leader):
    make_node("gpu-a")
    make_model("llama")
    paused = PausedLeadership(ttl=60)
    paused.owner, paused.held, paused.epoch = leader.owner, True, leader.epoch
    from reconciler.models import Lease

    Lease.objects.update(expires_at=0)
    assert Leadership(ttl=60).renew()  # another process takes over at epoch 2

    result = tick(leadership=paused)

    assert result.leader is False
    assert Replica.objects.count() == 0
    assert current_epoch() == 2
