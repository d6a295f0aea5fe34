"""Token usage per API key, model and hour, added to `TokenUsage`; keys' last use moved into `ApiKey`; answers
whose engine broke off per model and hour, added to `ContinuationHour`.

Whoever took the counts from the hub stores them here: the control plane's
tick (reconciler.demand.tokens), or in router-only mode the router's own token store
(router.accounting.store). A fixed number of queries: one read of the keys, one
upsert per `UPSERT_BATCH` rows, one update (continuations: one upsert per batch).
Each row's spend is what the routers charged (each answer's tokens at the prices of
the endpoint table that served it, or its budgets' settlement: hub.budgets), with the
key's team and holder now. The upsert adds in the database
(`INSERT … ON CONFLICT DO UPDATE SET n = n + excluded.n`, the same statement on
SQLite and PostgreSQL), so two processes storing what each took at once still add up.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from django.db import connection, models, transaction
from django.db.models import Case, DateTimeField, Value, When
from django.db.models.functions import Coalesce, Greatest

from hub.contracts import ContinuationCounts, ReplicaTokens, TokenCounts
from keys.models import ApiKey, ContinuationHour, TokenUsage
from keys.models import ReplicaTokens as ReplicaTokensRow

log = logging.getLogger(__name__)

# Rows per INSERT: 10 parameters each stays under SQLite's oldest limit of 999 variables.
UPSERT_BATCH = 90
TOKEN_COLUMNS = ["key_id", "key_name", "model", "hour", "team_id", "user_id"]
TOKEN_ADDED = ["requests", "prompt_tokens", "completion_tokens", "spend_units"]
REPLICA_COLUMNS = ["replica_id", "hour", "key_id", "team_id", "tokens"]
CONTINUATION_COLUMNS = ["model", "hour", "continued", "failed", "refused", "reprocessed_prompt_tokens"]


def store_tokens(
    tokens: dict[int, TokenCounts], keys: dict[str, float], replicas: dict[int, ReplicaTokens] | None = None
) -> int:
    """Add `tokens` ({hour start: {digest: {model: TokenCount}}}) to TokenUsage, `replicas` ({hour start: {replica
    id: {digest: tokens}}}) to ReplicaTokens, and move `keys` (digest -> last use) into ApiKey.last_used_at; one
    transaction. Unknown digests are dropped."""
    replicas = replicas or {}
    digests = set(keys)
    for counts in tokens.values():
        digests.update(counts)
    for per_replica in replicas.values():
        for served in per_replica.values():
            digests.update(served)
    if not digests:
        return 0
    with transaction.atomic():
        columns = ("id", "key_hash", "name", "team_id", "user_id")
        known = {row[1]: row for row in ApiKey.objects.filter(key_hash__in=digests).values_list(*columns)}
        unknown = digests - set(known)
        if unknown:
            log.warning("dropping token usage of %d unknown API key(s) (deleted since?)", len(unknown))
        rows = []
        for hour, counts in sorted(tokens.items()):
            for digest, models_used in counts.items():
                if digest not in known:
                    continue
                pk, _, name, team, user = known[digest]
                for model, count in models_used.items():
                    rows.append(
                        (
                            pk,
                            name,
                            model,
                            hour_param(hour),
                            team,
                            user,
                            count.requests,
                            count.prompt,
                            count.completion,
                            count.spend,
                        )
                    )
        for start in range(0, len(rows), UPSERT_BATCH):
            batch = rows[start : start + UPSERT_BATCH]
            upsert_adding(TokenUsage, [*TOKEN_COLUMNS, *TOKEN_ADDED], ["key_id", "model", "hour"], TOKEN_ADDED, batch)
        _store_replica_tokens(replicas, {digest: (row[0], row[3]) for digest, row in known.items()})
        _stamp_last_use({known[d][0]: ts for d, ts in keys.items() if d in known})
    return len(rows)


def _store_replica_tokens(replicas: dict[int, ReplicaTokens], known: dict[str, tuple[int, int | None]]) -> None:
    """Add tokens per replica and key to ReplicaTokens (the showback's shares), with each key's team now."""
    rows = [
        (int(replica), hour_param(hour), *known[digest], amount)
        for hour, per_replica in sorted(replicas.items())
        for replica, served in per_replica.items()
        if replica.isdigit()  # a control plane's replica; router-only endpoints' names have no GPU time to share
        for digest, amount in served.items()
        if digest in known
    ]
    for start in range(0, len(rows), UPSERT_BATCH):
        batch = rows[start : start + UPSERT_BATCH]
        upsert_adding(ReplicaTokensRow, REPLICA_COLUMNS, ["replica_id", "hour", "key_id"], ["tokens"], batch)


def store_continuations(continuations: dict[int, ContinuationCounts]) -> int:
    """Add `continuations` ({hour start: {model: ContinuationCount}}) to ContinuationHour; one transaction, one
    upsert per UPSERT_BATCH rows. Returns the number of (model, hour) rows added to."""
    rows = [
        (model, hour_param(hour), count.continued, count.failed, count.refused, count.reprocessed)
        for hour, counts in sorted(continuations.items())
        for model, count in sorted(counts.items())
    ]
    with transaction.atomic():
        for start in range(0, len(rows), UPSERT_BATCH):
            batch = rows[start : start + UPSERT_BATCH]
            upsert_adding(ContinuationHour, CONTINUATION_COLUMNS, ["model", "hour"], CONTINUATION_COLUMNS[2:], batch)
    return len(rows)


def hour_param(start: int) -> Any:
    """An hour's start (Unix seconds) as the database takes a datetime parameter."""
    return connection.ops.adapt_datetimefield_value(datetime.fromtimestamp(start, tz=UTC))


def upsert_adding(
    model: type[models.Model], columns: list[str], unique: list[str], added: list[str], rows: list[tuple[Any, ...]]
) -> None:
    """Add each row (values of `columns`) to the row its `unique` columns name, creating it if need be: one
    statement. The `added` columns add up; the others not in `unique` take the row's value (a key's name now)."""
    quote = connection.ops.quote_name
    table = quote(model._meta.db_table)
    updates = [
        f"{quote(c)} = {table}.{quote(c)} + excluded.{quote(c)}" if c in added else f"{quote(c)} = excluded.{quote(c)}"
        for c in columns
        if c not in unique
    ]
    placeholders = ", ".join(["(" + ", ".join(["%s"] * len(columns)) + ")"] * len(rows))
    sql = (
        f"INSERT INTO {table} ({', '.join(quote(c) for c in columns)}) VALUES {placeholders} "
        f"ON CONFLICT ({', '.join(quote(c) for c in unique)}) DO UPDATE SET {', '.join(updates)}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [value for row in rows for value in row])


def _stamp_last_use(last_use: dict[int, float]) -> None:
    """ApiKey.last_used_at = the later of what it has and the reported use: one UPDATE, newest wins."""
    if not last_use:
        return
    reported = Case(
        *[
            When(pk=pk, then=Value(datetime.fromtimestamp(ts, tz=UTC), output_field=DateTimeField()))
            for pk, ts in last_use.items()
        ],
        output_field=DateTimeField(),
    )
    # In SQL, not read-then-write: a concurrent older stamp can never move a newer one back.
    ApiKey.objects.filter(pk__in=list(last_use)).update(
        last_used_at=Greatest(Coalesce("last_used_at", reported), reported)
    )
