"""The leader lease: one row, taken and renewed by one statement (DESIGN invariant 1).

Expiry is judged by the database's clock, never the caller's, so leaders on
hosts with skewed clocks still agree. Each takeover bumps the row's epoch; the
placement transaction re-checks that epoch (`assert_still_leader`) so a leader
that paused past its lease cannot commit placements on stale beliefs.
"""

from __future__ import annotations

import logging
import threading
import uuid
from datetime import datetime

from django.conf import settings
from django.db import DatabaseError, InterfaceError, connection
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


def try_acquire(name: str, owner: str, ttl: float) -> tuple[bool, int]:
    """Take or renew lease `name` for `owner` for `ttl` seconds; return (held, epoch).

    One statement: it inserts the row, or updates it when `owner` already holds
    it or it has expired by the database clock. The epoch stays the same on
    renewal and increments on takeover. When not held, the epoch returned is 0.
    """
    _check(name, owner)
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
        raise ValueError(f"lease ttl must be a positive number of seconds, got {ttl!r}")
    now = _db_now()
    sql = (
        f"INSERT INTO {TABLE} (name, owner, epoch, expires_at) VALUES (%s, %s, 1, {now} + %s) "
        f"ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, "
        f"epoch = CASE WHEN {TABLE}.owner = excluded.owner THEN {TABLE}.epoch ELSE {TABLE}.epoch + 1 END, "
        f"expires_at = excluded.expires_at "
        f"WHERE {TABLE}.owner = excluded.owner OR {TABLE}.expires_at < {now} "
        f"RETURNING epoch"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [name, owner, float(ttl)])
        row = cursor.fetchone()
    return (True, int(row[0])) if row else (False, 0)


def assert_still_leader(name: str, owner: str, epoch: int) -> None:
    """Inside a transaction: raise LeaseLost unless `owner` still holds `name` at `epoch`, unexpired.

    The UPDATE touches the lease row, so on PostgreSQL it also locks it until
    commit: a competing takeover waits for our placements instead of racing them.
    """
    _check(name, owner)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {TABLE} SET epoch = epoch WHERE name = %s AND owner = %s AND epoch = %s AND expires_at > {_db_now()}",
            [name, owner, epoch],
        )
        if cursor.rowcount != 1:
            raise LeaseLost(f"lease “{name}” is no longer held by {owner} at epoch {epoch}")


def release(name: str, owner: str) -> bool:
    """Give the lease up (clean shutdown) if `owner` holds it; return whether it did.

    The row is expired rather than deleted: deleting it would restart the epoch
    at 1, and agents refuse commands older than the newest epoch they have seen.
    """
    _check(name, owner)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {TABLE} SET expires_at = 0 WHERE name = %s AND owner = %s", [name, owner])
        return cursor.rowcount == 1


class Leadership:
    """This process's claim on the lease: owner id, whether it is held, its epoch and since when.

    The owner id is a fresh random hex per instance (one per process start),
    never the hostname: two processes on one host, or a restarted process, must
    not mistake each other's claim for their own.
    """

    def __init__(self, name: str | None = None, ttl: float | None = None):
        self.name = name or settings.LLMGW_LEASE_NAME
        self.ttl = float(ttl if ttl is not None else settings.LLMGW_LEASE_TTL_SECONDS)
        self.owner = uuid.uuid4().hex
        self.held = False
        self.epoch = 0
        # When this process became leader at the current epoch; a young leader
        # declares no node lost (it has not yet watched a whole heartbeat window).
        self.leader_since: datetime | None = None

    def renew(self) -> bool:
        """Take or renew the lease; return whether this process leads.

        A database error keeps the previous answer: the store being briefly
        unreachable must not leave the fleet without a leader (DESIGN invariant 1).
        """
        try:
            held, epoch = try_acquire(self.name, self.owner, self.ttl)
        except (DatabaseError, InterfaceError) as exc:
            log.warning("lease %s: store unreachable, keeping held=%s: %s", self.name, self.held, exc)
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

    def release(self) -> None:
        """Give the lease up on clean shutdown so a standby takes over without waiting for expiry."""
        try:
            release(self.name, self.owner)
        except (DatabaseError, InterfaceError) as exc:
            log.warning("lease %s: could not release: %s", self.name, exc)
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
