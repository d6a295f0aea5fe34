"""The leader lease (DESIGN invariant 1), on whichever database DATABASE_URL names.

The same assertions run on SQLite and PostgreSQL: run this file once with and
once without DATABASE_URL.
"""

import socket
import threading
import time

import pytest
from django.db import OperationalError, connection, connections, transaction

from inventory.models import Node
from reconciler.leadership.lease import (
    Leadership,
    LeaseLost,
    assert_still_leader,
    get_leadership,
    release,
    try_acquire,
)
from reconciler.models import Lease

pytestmark = pytest.mark.django_db


def expire(name):
    Lease.objects.filter(name=name).update(expires_at=0)


def test_first_caller_takes_the_lease_at_epoch_1():
    assert try_acquire("lease-t", "owner-a", 10) == (True, 1)
    row = Lease.objects.get(name="lease-t")
    assert (row.owner, row.epoch) == ("owner-a", 1)


def test_lease_is_not_taken_while_held_by_another():
    try_acquire("lease-t", "owner-a", 10)
    assert try_acquire("lease-t", "owner-b", 10) == (False, 0)
    assert Lease.objects.get(name="lease-t").owner == "owner-a"


def test_holder_renews_and_keeps_its_epoch_and_pushes_expiry_forward():
    try_acquire("lease-t", "owner-a", 1)
    first_expiry = Lease.objects.get(name="lease-t").expires_at
    assert try_acquire("lease-t", "owner-a", 60) == (True, 1)
    assert Lease.objects.get(name="lease-t").expires_at > first_expiry + 50


def test_expired_lease_is_taken_over_and_the_epoch_increments():
    try_acquire("lease-t", "owner-a", 10)
    expire("lease-t")
    assert try_acquire("lease-t", "owner-b", 10) == (True, 2)
    assert try_acquire("lease-t", "owner-a", 10) == (False, 0)
    assert try_acquire("lease-t", "owner-b", 10) == (True, 2)


def test_expiry_is_judged_by_the_database_clock():
    assert try_acquire("lease-t", "owner-a", 0.2) == (True, 1)
    assert try_acquire("lease-t", "owner-b", 10) == (False, 0)
    time.sleep(0.3)
    assert try_acquire("lease-t", "owner-b", 10) == (True, 2)


def test_bad_arguments_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="ttl"):
        try_acquire("lease-t", "owner-a", 0)
    with pytest.raises(ValueError, match="owner"):
        try_acquire("lease-t", "", 10)
    with pytest.raises(ValueError, match="name"):
        try_acquire("", "owner-a", 10)


def test_owner_id_is_random_per_leadership_and_never_the_hostname():
    one, two = Leadership(name="lease-t"), Leadership(name="lease-t")
    assert one.owner != two.owner
    assert socket.gethostname() not in (one.owner, two.owner)
    assert get_leadership() is get_leadership()


def test_leadership_tracks_held_epoch_and_since_when():
    one, two = Leadership(name="lease-t", ttl=10), Leadership(name="lease-t", ttl=10)
    assert one.renew() is True
    assert (one.held, one.epoch) == (True, 1)
    assert one.leader_since is not None
    assert two.renew() is False
    assert (two.held, two.leader_since) == (False, None)


def test_release_lets_another_take_over_at_a_higher_epoch():
    one, two = Leadership(name="lease-t", ttl=60), Leadership(name="lease-t", ttl=60)
    one.renew()
    one.release()
    assert one.held is False
    assert two.renew() is True
    # Epochs never go back, or agents that saw the old one would refuse the new leader.
    assert two.epoch == 2
    assert release("lease-t", one.owner) is False


def test_renew_keeps_the_claim_when_the_store_is_unreachable(monkeypatch):
    """The database error is injected here (the one place in these tests): a cursor that raises
    OperationalError stands for a store that cannot be reached."""
    leader, standby = Leadership(name="lease-t", ttl=10), Leadership(name="lease-t", ttl=10)
    assert leader.renew() is True
    assert standby.renew() is False

    def unreachable(*args, **kwargs):
        raise OperationalError("could not connect to server")

    monkeypatch.setattr(connections["default"], "cursor", unreachable)
    assert leader.renew() is True
    assert (leader.held, leader.epoch) == (True, 1)
    assert standby.renew() is False


def test_fencing_guard_passes_while_the_lease_is_ours():
    leader = Leadership(name="lease-t", ttl=10)
    leader.renew()
    with transaction.atomic():
        leader.assert_still_leader()
        Node.objects.create(name="gpu-a")
    assert Node.objects.filter(name="gpu-a").exists()


def test_fencing_guard_refuses_a_commit_after_another_owner_took_over():
    leader, usurper = Leadership(name="lease-t", ttl=10), Leadership(name="lease-t", ttl=10)
    leader.renew()
    expire("lease-t")  # the leader paused past its lease
    assert usurper.renew() is True
    with pytest.raises(LeaseLost), transaction.atomic():
        Node.objects.create(name="gpu-a")
        leader.assert_still_leader()
    assert not Node.objects.filter(name="gpu-a").exists()


def test_fencing_guard_refuses_an_expired_lease_even_without_a_new_owner():
    try_acquire("lease-t", "owner-a", 10)
    expire("lease-t")
    with pytest.raises(LeaseLost):
        assert_still_leader("lease-t", "owner-a", 1)


@pytest.mark.django_db(transaction=True)
def test_racing_owners_on_a_free_lease_exactly_one_wins():
    racers = 8
    barrier = threading.Barrier(racers)
    results, errors = [], []

    def race(i):
        try:
            barrier.wait(timeout=5)
            results.append(try_acquire("lease-race", f"owner-{i}", 30))
        except Exception as exc:  # surfaced below: a racer must not crash
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=race, args=(i,)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert errors == []
    assert sorted(results, reverse=True) == [(True, 1)] + [(False, 0)] * (racers - 1)
    assert Lease.objects.get(name="lease-race").epoch == 1
