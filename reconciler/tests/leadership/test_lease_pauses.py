"""A paused leader (DESIGN invariant 1), with real threads on real connections to whichever database
DATABASE_URL names: a takeover does not wait for it, its tick commits nothing when it resumes, and an
expiry written after a wait for the lease row still gives a whole TTL.

The pause is a thread stopped at a point inside the tick, as SIGSTOP would stop a process there.
"""

import threading
import time
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from conftest import wait_until
from hub import get_hub
from inventory.choices import NodeState
from inventory.models import Node
from reconciler import tick as tick_module
from reconciler.leadership.lease import Leadership, _db_now, try_acquire
from reconciler.models import Lease, Replica
from reconciler.tick import tick
from tests.fleet import make_model, make_node

pytestmark = pytest.mark.django_db(transaction=True)

# SQLite has one writer at a time: a paused writer holds every other writer (embedded mode has one ticker).
postgres_only = pytest.mark.postgres_only

# How long a paused thread waits before it resumes on its own, so a broken rule fails the test instead of hanging it.
PAUSE_LIMIT = 5.0


def take_over(standby: Leadership) -> float:
    """Let `standby` campaign until it leads (3 s at most); return its slowest attempt in seconds."""
    slowest = 0.0

    def attempt() -> bool:
        nonlocal slowest
        started = time.monotonic()
        won = standby.renew()
        slowest = max(slowest, time.monotonic() - started)
        return won

    wait_until(attempt, timeout=3, interval=0.05)
    return slowest


class PausedTick:
    """`tick()` in a thread of its own, stopped inside its transaction after demand has written its rows."""

    def __init__(self, monkeypatch, leadership):
        self.leadership = leadership
        self.inside, self.resume = threading.Event(), threading.Event()
        self.report, self.error = None, None
        real_apply_demand = tick_module.apply_demand

        def apply_demand_then_pause(*args, **kwargs):
            result = real_apply_demand(*args, **kwargs)
            if threading.current_thread() is self.thread:
                self.inside.set()
                self.resume.wait(PAUSE_LIMIT)
            return result

        monkeypatch.setattr(tick_module, "apply_demand", apply_demand_then_pause)
        self.thread = threading.Thread(target=self._run)

    def _run(self):
        try:
            self.report = tick(leadership=self.leadership, hub=get_hub())
        except Exception as exc:  # surfaced by the test
            self.error = exc
        finally:
            connection.close()

    def start(self):
        self.thread.start()
        assert self.inside.wait(PAUSE_LIMIT), f"the tick never reached its pause point: {self.error!r}"

    def finish(self):
        self.resume.set()
        self.thread.join(PAUSE_LIMIT)
        assert not self.thread.is_alive()


@pytest.fixture
def silent_fleet():
    """A node silent for a day (the tick marks it unreachable) and a model wanting one replica."""
    node = make_node("gpu-a")
    Node.objects.filter(pk=node.pk).update(last_seen=timezone.now() - timedelta(days=1))
    make_model("llama")
    return node


def paused_leader(ttl=1.0):
    """A leader whose paused tick's session the server does not cut: the fence alone must stop it."""
    leader = Leadership(ttl=ttl, idle_timeout=60)
    assert leader.renew()
    return leader


def database_now() -> float:
    """The database's clock in seconds since the Unix epoch: the clock lease expiry is judged by."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {_db_now()}")
        return float(cursor.fetchone()[0])


def lease_expired():
    return Lease.objects.get(name=settings.LLMGW_LEASE_NAME).expires_at < database_now()


@postgres_only
def test_a_takeover_does_not_wait_for_a_leader_paused_inside_its_tick(monkeypatch, silent_fleet):
    paused = PausedTick(monkeypatch, paused_leader())
    paused.start()
    try:
        standby = Leadership(ttl=10)
        # The paused leader's lease (1 s) runs out; the standby's attempts neither block nor fail meanwhile.
        slowest = take_over(standby)
        assert slowest < 0.5, f"a takeover attempt waited {slowest:.2f} s for the paused leader"
        assert standby.epoch == 2
        assert paused.thread.is_alive()  # still paused inside its transaction
    finally:
        paused.finish()


def test_a_tick_whose_lease_expired_while_it_was_paused_commits_nothing(monkeypatch, silent_fleet, caplog):
    paused = PausedTick(monkeypatch, paused_leader())
    paused.start()
    try:
        wait_until(lease_expired, timeout=3, interval=0.05)
        if connection.vendor == "postgresql":  # SQLite's one writer is the paused tick: no takeover there
            assert Leadership(ttl=10).renew()
    finally:
        paused.finish()

    assert paused.error is None
    assert paused.report.leader is False
    assert "tick abandoned, nothing committed" in caplog.text
    assert Replica.objects.count() == 0
    assert Node.objects.get(pk=silent_fleet.pk).state == NodeState.READY


def test_a_tick_that_keeps_its_lease_commits():
    """The other side of the fence: an unpaused tick of a leader commits its rows."""
    make_node("gpu-a")
    make_model("llama")
    report = tick(leadership=paused_leader(ttl=10), hub=get_hub())
    assert report.leader is True
    assert Replica.objects.count() == 1


@postgres_only
def test_a_leader_paused_after_its_fence_holds_a_takeover_only_until_the_server_cuts_it():
    """Paused between the fence (which locks the lease row) and COMMIT: each takeover attempt gives up
    after its lock timeout, the server cuts the idle transaction, and the standby wins; nothing commits."""
    leader = Leadership(ttl=1.0)  # its transaction is cut after 0.5 s idle
    assert leader.renew()
    fenced, resume = threading.Event(), threading.Event()
    errors = []

    def paused_after_fence():
        try:
            with transaction.atomic():
                with leader.fenced_transaction():
                    Node.objects.create(name="gpu-z")
                fenced.set()
                resume.wait(PAUSE_LIMIT)
        except Exception as exc:  # the commit of a cut session fails
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=paused_after_fence)
    thread.start()
    try:
        assert fenced.wait(PAUSE_LIMIT)
        standby = Leadership(ttl=10, lock_timeout=0.1)
        slowest = take_over(standby)
        assert slowest < 0.1 + 0.3, f"a takeover attempt waited {slowest:.2f} s"
        assert thread.is_alive()  # the standby won while the old leader was still paused
    finally:
        resume.set()
        thread.join(PAUSE_LIMIT)

    assert errors, "the paused transaction committed after its session should have been cut"
    assert not Node.objects.filter(name="gpu-z").exists()


def test_an_expiry_written_after_waiting_for_the_row_counts_from_the_end_of_the_wait():
    """The old leader's transaction holds the lease row (PostgreSQL: the fence's row lock; SQLite: the
    write lock) for a while; the takeover waiting behind it must still get a whole TTL."""
    try_acquire("lease-c", "owner-a", 10)
    Lease.objects.filter(name="lease-c").update(expires_at=0)
    locked, hold = threading.Event(), 0.5

    def hold_the_row():
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("UPDATE reconciler_lease SET epoch = epoch WHERE name = %s", ["lease-c"])
                locked.set()
                threading.Event().wait(hold)  # the old leader, paused before its COMMIT
        finally:
            connection.close()

    holder = threading.Thread(target=hold_the_row)
    holder.start()
    try:
        assert locked.wait(PAUSE_LIMIT)
        started = time.monotonic()
        assert try_acquire("lease-c", "owner-b", 10, lock_timeout=3) == (True, 2)
        waited = time.monotonic() - started
        after = database_now()
    finally:
        holder.join(PAUSE_LIMIT)

    assert waited > hold / 2, "the takeover did not wait for the row: the test proves nothing"
    expires_at = Lease.objects.get(name="lease-c").expires_at
    assert expires_at >= after + 10 - 0.1, f"only {expires_at - after:.2f} s of a 10 s lease left at completion"
