"""The leader lease: one row, taken and renewed by one statement (DESIGN invariant 1).

Expiry is judged by the database's clock, never the caller's, so leaders on
hosts with skewed clocks still agree, and it counts from when the statement
completes, after any wait for the row. Each takeover bumps the row's epoch. The
tick's transaction (`Leadership.fenced_transaction`) holds no lock on the lease
row while it works: its last statement, just before COMMIT, checks that the
epoch is still ours and the lease unexpired, so a leader that paused past its
lease commits nothing, and a paused leader never makes a takeover wait. On
PostgreSQL every lease statement waits at most `lock_timeout` for the row, and
a tick's transaction left idle (its process paused) is cut by the server after
`idle_timeout`, which releases whatever it had locked.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

from django.conf import settings
from django.db import DatabaseError, InterfaceError, connection, transaction
from django.utils import timezone

log = logging.getLogger(__name__)

TABLE = "reconciler_lease"

_SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"
# clock_timestamp(), not now(): now() is frozen at the start of the transaction.
_POSTGRES_NOW = "EXTRACT(EPOCH FROM clock_timestamp())::float8"


class LeaseLost(Exception):
    """The lease is no longer ours at this epoch; the transaction must not commit."""


def _db_now() -> str:
    if connection.vendor == "postgresql":
        return _POSTGRES_NOW
    if connection.vendor == "sqlite":
        return _SQLITE_NOW
    raise DatabaseError(f"the lease supports SQLite and PostgreSQL, not {connection.vendor}")


def _check(name: str, owner: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError("lease name must be a non-empty string")
    if not isinstance(owner, str) or not owner or len(owner) > 64:
        raise ValueError("lease owner must be a non-empty string of at most 64 characters")


def lock_timeout_for(ttl: float) -> float:
    """How long a lease statement waits for the row: short against the TTL (at most 1 s)."""
    return min(1.0, ttl / 10)


def idle_timeout_for(ttl: float) -> float:
    """How long a tick's transaction may sit idle before the server cuts it: half the TTL.

    Well above the gaps between a tick's statements, and below the TTL, so a
    leader paused mid-tick has released its row locks by the time its lease
    can be taken over.
    """
    return ttl / 2


def limit_waits(lock_timeout: float, idle_timeout: float | None = None) -> None:
    """Inside a transaction on PostgreSQL: bound its lock waits (and its idle time) until it ends.

    SQLite has no such settings: it has one writer at a time, and its busy
    timeout bounds the wait for it.
    """
    if connection.vendor != "postgresql":
        return
    sql, params = "SELECT set_config('lock_timeout', %s, true)", [_milliseconds(lock_timeout)]
    if idle_timeout is not None:
        sql += ", set_config('idle_in_transaction_session_timeout', %s, true)"
        params.append(_milliseconds(idle_timeout))
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def _milliseconds(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def try_acquire(name: str, owner: str, ttl: float, lock_timeout: float | None = None) -> tuple[bool, int]:
    """Take or renew lease `name` for `owner` for `ttl` seconds; return (held, epoch).

    One statement: it inserts the row, or updates it when `owner` already holds
    it or it has expired by the database clock. The epoch stays the same on
    renewal and increments on takeover. When not held, the epoch returned is 0.

    The new expiry is computed in the update's SET, which the database
    evaluates once it holds the row: a statement that had to wait for the row
    still gets a whole TTL from when it completes, not from when it started.
    On PostgreSQL it waits for the row at most `lock_timeout` seconds (default
    `lock_timeout_for(ttl)`), then raises OperationalError.
    """
    _check(name, owner)
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
        raise ValueError(f"lease ttl must be a positive number of seconds, got {ttl!r}")
    now = _db_now()
    sql = (
        f"INSERT INTO {TABLE} (name, owner, epoch, expires_at) VALUES (%s, %s, 1, {now} + %s) "
        f"ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, "
        f"epoch = CASE WHEN {TABLE}.owner = excluded.owner THEN {TABLE}.epoch ELSE {TABLE}.epoch + 1 END, "
        f"expires_at = {now} + %s "
        f"WHERE {TABLE}.owner = excluded.owner OR {TABLE}.expires_at < {now} "
        f"RETURNING epoch"
    )
    with transaction.atomic():
        limit_waits(lock_timeout_for(ttl) if lock_timeout is None else lock_timeout)
        with connection.cursor() as cursor:
            cursor.execute(sql, [name, owner, float(ttl), float(ttl)])
            row = cursor.fetchone()
    return (True, int(row[0])) if row else (False, 0)


def assert_still_leader(name: str, owner: str, epoch: int) -> None:
    """The fence, the last statement of a tick's transaction: raise LeaseLost unless `owner`
    still holds `name` at `epoch`, unexpired by the database clock.

    The UPDATE locks the lease row until COMMIT, so a takeover cannot slip in
    between this check and the commit; the lock is held only for that instant
    (a takeover waits for it at most its `lock_timeout`, and a leader paused
    right here is cut by its transaction's idle timeout).
    """
    _check(name, owner)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {TABLE} SET epoch = epoch WHERE name = %s AND owner = %s AND epoch = %s AND expires_at > {_db_now()}",
            [name, owner, epoch],
        )
        if cursor.rowcount != 1:
            raise LeaseLost(f"lease “{name}” is no longer held by {owner} at epoch {epoch}")


def release(name: str, owner: str, lock_timeout: float = 1.0) -> bool:
    """Give the lease up (clean shutdown) if `owner` holds it; return whether it did.

    The row is expired rather than deleted: deleting it would restart the epoch
    at 1, and agents refuse commands older than the newest epoch they have seen.
    """
    _check(name, owner)
    with transaction.atomic():
        limit_waits(lock_timeout)
        with connection.cursor() as cursor:
            cursor.execute(f"UPDATE {TABLE} SET expires_at = 0 WHERE name = %s AND owner = %s", [name, owner])
            return cursor.rowcount == 1


class Leadership:
    """This process's claim on the lease: owner id, whether it is held, its epoch and since when.

    The owner id is a fresh random hex per instance (one per process start),
    never the hostname: two processes on one host, or a restarted process, must
    not mistake each other's claim for their own. Safe to share between threads
    (a Celery worker renews from a thread of its own while its tasks tick).
    """

    def __init__(
        self,
        name: str | None = None,
        ttl: float | None = None,
        lock_timeout: float | None = None,
        idle_timeout: float | None = None,
    ):
        self.name = name or settings.LLMGW_LEASE_NAME
        self.ttl = float(ttl if ttl is not None else settings.LLMGW_LEASE_TTL_SECONDS)
        self.lock_timeout = float(lock_timeout if lock_timeout is not None else lock_timeout_for(self.ttl))
        self.idle_timeout = float(idle_timeout if idle_timeout is not None else idle_timeout_for(self.ttl))
        self.owner = uuid.uuid4().hex
        self.held = False
        self.epoch = 0
        # When this process became leader at the current epoch; a young leader
        # declares no node lost (it has not yet watched a whole heartbeat window).
        self.leader_since: datetime | None = None
        # When this process's tick next sweeps the nodes' unused weights (reconciler.weights.sweep).
        self.next_weights_sweep: datetime | None = None
        self.next_stall_check: datetime | None = None  # when the tick next looks for stalled stages
        # When this process's tick next counts the replicas' GPU time (reconciler.demand.gpu_time).
        self.next_gpu_count: datetime | None = None
        self._lock = threading.Lock()

    def renew(self) -> bool:
        """Take or renew the lease; return whether this process leads.

        A database error keeps the previous answer: the store being briefly
        unreachable must not leave the fleet without a leader (DESIGN invariant 1).
        """
        with self._lock:
            try:
                held, epoch = try_acquire(self.name, self.owner, self.ttl, self.lock_timeout)
            except (DatabaseError, InterfaceError) as exc:
                log.warning("lease %s: store unreachable or busy, keeping held=%s: %s", self.name, self.held, exc)
                if not connection.in_atomic_block:
                    # Drop the broken connection so the next renew reconnects.
                    connection.close_if_unusable_or_obsolete()
                return self.held
            if held and (not self.held or epoch != self.epoch):
                self.leader_since = timezone.now()
                log.info("lease %s: leader as %s at epoch %d", self.name, self.owner, epoch)
            elif not held and self.held:
                log.warning("lease %s: lost leadership (owner %s, epoch %d)", self.name, self.owner, self.epoch)
            if not held:
                self.leader_since = None
            self.held = held
            self.epoch = epoch if held else self.epoch
            return held

    def assert_still_leader(self) -> None:
        """The fencing check for the current transaction (see module `assert_still_leader`)."""
        if not self.held:
            raise LeaseLost(f"lease “{self.name}” is not held by this process")
        assert_still_leader(self.name, self.owner, self.epoch)

    @contextmanager
    def fenced_transaction(self) -> Iterator[None]:
        """A transaction that commits only if the lease is still ours at this epoch, unexpired, at its end.

        It takes no lock on the lease row while the body runs: the fence is its
        last statement, so a takeover never waits for a paused leader, and a
        leader whose lease expired mid-way commits nothing (LeaseLost from the
        fence rolls it back). On PostgreSQL its lock waits are bounded by
        `lock_timeout` and the server cuts it if it sits idle for `idle_timeout`.
        """
        with transaction.atomic():
            limit_waits(self.lock_timeout, self.idle_timeout)
            yield
            self.assert_still_leader()

    def release(self) -> None:
        """Give the lease up on clean shutdown so a standby takes over without waiting for expiry."""
        with self._lock:
            try:
                release(self.name, self.owner, self.lock_timeout)
            except (DatabaseError, InterfaceError) as exc:
                log.warning("lease %s: could not release: %s", self.name, exc)
            else:
                if self.held:
                    log.info("lease %s: released by %s at epoch %d", self.name, self.owner, self.epoch)
            self.held = False
            self.leader_since = None

    def __repr__(self) -> str:
        return f"<Leadership {self.name} owner={self.owner} held={self.held} epoch={self.epoch}>"


_leadership: Leadership | None = None
_leadership_lock = threading.Lock()


def get_leadership() -> Leadership:
    """The process-wide Leadership (created on first use, after any fork)."""
    global _leadership
    with _leadership_lock:
        if _leadership is None:
            _leadership = Leadership()
        return _leadership
