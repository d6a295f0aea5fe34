"""Spend at scale on PostgreSQL: a key's and a team's spend for a month, answered from the hourly rows while a year
of them and a million per-request records are stored; and what a per-request record costs on disk.

    .venv/bin/python bench/spend_bench.py [--keys 100] [--teams 10] [--models 2] [--records 1000000]
                                          [--replicas 50] [--keys-per-replica 4]
                                          [--database postgres://postgres@127.0.0.1:5432/postgres] [--runs 200]

A database of its own (`llmgw_spend_bench`, made afresh on the server `--database` names) is migrated and filled
in SQL (generate_series): `--keys` keys in `--teams` teams, each with an hourly TokenUsage row for each of
`--models` models for every hour of a year, and `--records` RequestRecord rows spread over the last 30 days. Then
the spend of one key and of one team for one month is asked `--runs` times each through the ORM, as the pages
and the REST API ask it (keys.TokenUsage, SUM of spend_units over the month's hours), and the latencies are
reported with the plan PostgreSQL chose; and the size of the per-request table with its indexes per row. Last,
the showback of a month (keys.showback) over `--replicas` replicas' GPU time for every hour of a year, each hour
shared by `--keys-per-replica` keys (a tenth of the hours idle).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BENCH_DATABASE = "llmgw_spend_bench"


def make_database(server: str) -> str:
    import psycopg

    with psycopg.connect(server, autocommit=True) as connection:
        connection.execute(f"DROP DATABASE IF EXISTS {BENCH_DATABASE}")
        connection.execute(f"CREATE DATABASE {BENCH_DATABASE}")
    return server.rsplit("/", 1)[0] + "/" + BENCH_DATABASE


def fill(args: argparse.Namespace) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO teams_team (name, allowed_models, created_at) "
            "SELECT 'team-' || t, '[]', now() FROM generate_series(1, %s) t",
            [args.teams],
        )
        cursor.execute(
            "INSERT INTO keys_apikey (name, prefix, key_hash, active, created_at, allowed_models, allowed_pools, "
            "team_id) SELECT 'key-' || k, 'sk-' || k, md5(k::text) || md5((k + 1)::text), true, now(), '[]', '[]', "
            "(SELECT id FROM teams_team ORDER BY id OFFSET (k %% %s) LIMIT 1) FROM generate_series(1, %s) k",
            [args.teams, args.keys],
        )
        started = time.perf_counter()
        cursor.execute(
            "INSERT INTO keys_tokenusage (key_id, key_name, model, hour, requests, prompt_tokens, "
            "completion_tokens, spend_units, team_id) "
            "SELECT k.id, k.name, 'model-' || m, date_trunc('hour', now()) - h * interval '1 hour', 10, 5000, 2000, "
            "(h * 7919 + k.id * 104729 + m) %% 1000000000, k.team_id "
            "FROM keys_apikey k, generate_series(0, 8759) h, generate_series(1, %s) m",
            [args.models],
        )
        cursor.execute(
            "INSERT INTO keys_requestrecord (at, key_id, team_id, model, status, prompt_tokens, completion_tokens, "
            "spend_units, milliseconds) "
            "SELECT now() - (r %% 2592000) * interval '1 second', k.id, k.team_id, 'model-' || (r %% %s + 1), 200, "
            "r %% 4000, r %% 800, r %% 100000000, r %% 30000 "
            "FROM generate_series(1, %s) r JOIN keys_apikey k ON k.id = (SELECT min(id) FROM keys_apikey) + r %% %s",
            [args.models, args.records, args.keys],
        )
        # The showback's rows: each replica's every hour of a year, served by `--keys-per-replica` keys an hour.
        cursor.execute(
            "INSERT INTO keys_gpuhour (replica_id, model, hour, gpu_seconds) "
            "SELECT r, 'model-' || (r %% %s + 1), date_trunc('hour', now()) - h * interval '1 hour', 3600 * (r %% 4 + 1) "
            "FROM generate_series(1, %s) r, generate_series(0, 8759) h",
            [args.models, args.replicas],
        )
        cursor.execute(
            "INSERT INTO keys_replicatokens (replica_id, hour, key_id, team_id, tokens) "
            "SELECT g.replica_id, g.hour, k.id, k.team_id, 1000 + (g.id * 31 + j * 7) %% 50000 "
            "FROM keys_gpuhour g CROSS JOIN generate_series(0, %s - 1) j "
            "JOIN keys_apikey k ON k.id = (SELECT min(id) FROM keys_apikey) + (g.replica_id * 13 + j * 37) %% %s "
            "WHERE g.id %% 10 <> 0",  # a tenth of the hours idle
            [args.keys_per_replica, args.keys],
        )
        cursor.execute("VACUUM ANALYZE")  # as autovacuum leaves a table at rest: index-only scans need its map
        print(f"filled in {time.perf_counter() - started:.1f} s")


def timed(query, runs: int) -> tuple[float, float, float]:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        query()
        samples.append((time.perf_counter() - started) * 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1], samples[-1]


def measure(args: argparse.Namespace) -> None:
    from datetime import UTC, datetime, timedelta

    from django.db import connection
    from django.db.models import Sum

    from keys.models import ApiKey, RequestRecord, TokenUsage

    now = datetime.now(UTC)
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    previous = (start - timedelta(days=1)).replace(day=1)  # last month: every hour of it stored
    key = ApiKey.objects.order_by("id")[args.keys // 2]

    def key_month():
        return TokenUsage.objects.filter(key_id=key.pk, hour__gte=previous, hour__lt=start).aggregate(
            spend=Sum("spend_units")
        )["spend"]

    def team_month():
        return TokenUsage.objects.filter(team_id=key.team_id, hour__gte=previous, hour__lt=start).aggregate(
            spend=Sum("spend_units")
        )["spend"]

    hourly, records = TokenUsage.objects.count(), RequestRecord.objects.count()
    print(f"rows: {hourly:,} hourly (a year), {records:,} per-request records")
    for name, query in (("key", key_month), ("team", team_month)):
        query()  # warm
        p50, p99, worst = timed(query, args.runs)
        print(f"{name} spend for last month ({query()}): p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {worst:.2f} ms")
    with connection.cursor() as cursor:
        cursor.execute(
            "EXPLAIN (ANALYZE, BUFFERS) SELECT SUM(spend_units) FROM keys_tokenusage "
            "WHERE team_id = %s AND hour >= %s AND hour < %s",
            [key.team_id, previous, start],
        )
        print("team plan:", " / ".join(row[0].strip() for row in cursor.fetchall()[:3]))
        cursor.execute(
            "SELECT pg_table_size('keys_requestrecord'), pg_indexes_size('keys_requestrecord'), "
            "pg_total_relation_size('keys_requestrecord')"
        )
        table, indexes, total = cursor.fetchone()
    print(
        f"per-request record on disk: {table / records:.0f} B a row, {indexes / records:.0f} B of indexes, "
        f"{total / records:.0f} B in all"
    )
    showback_month(previous, start, args)


def showback_month(previous, start, args: argparse.Namespace) -> None:
    """Last month's showback (keys.showback), as `manage.py showback`, the REST API and the team summary ask it:
    divided from the replicas' hours, then summed from the hours the tick rolled up (as on a running fleet)."""
    from datetime import UTC, datetime

    from keys.models import GpuHour, ReplicaTokens
    from keys.showback import roll_up, showback

    print(f"showback rows: {GpuHour.objects.count():,} replica-hours, {ReplicaTokens.objects.count():,} shares")
    report = showback(previous, start)
    hours = report.total_seconds / 3600
    p50, p99, worst = timed(lambda: showback(previous, start), max(1, args.runs // 20))
    print(f"showback for last month divided ({hours:,.0f} GPU-hours): p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    began, now, rows, calls = time.perf_counter(), datetime.now(UTC), 0, 0
    while written := roll_up(now):  # a day a call, as the tick catches up after an upgrade
        rows, calls = rows + written, calls + 1
    elapsed = time.perf_counter() - began
    print(
        f"catching up a year: {rows:,} rows in {calls} roll-ups, {elapsed:.1f} s ({elapsed / calls * 1000:.0f} ms each)"
    )
    summed = showback(previous, start).rows  # rolled up or not, the same figures (floats summed in another order)
    assert [(r.team, r.model, r.tokens) for r in summed] == [(r.team, r.model, r.tokens) for r in report.rows]
    drift = max(abs(a.gpu_seconds - b.gpu_seconds) / b.gpu_seconds for a, b in zip(summed, report.rows, strict=True))
    print(f"rolled up and divided agree within {drift:.1e} (relative)")
    p50, p99, worst = timed(lambda: showback(previous, start), args.runs)
    print(f"showback for last month rolled up: p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {worst:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--teams", type=int, default=10)
    parser.add_argument("--models", type=int, default=2)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--replicas", type=int, default=50, help="Replicas with GPU time every hour of the year.")
    parser.add_argument("--keys-per-replica", type=int, default=4, help="Keys each replica serves each hour.")
    parser.add_argument("--database", default="postgres://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    os.environ["DATABASE_URL"] = make_database(args.database)
    os.environ.setdefault("SECRET_KEY", "bench-only")
    os.environ.setdefault("LLMGW_HOME", "/tmp/llmgw-spend-bench")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    fill(args)
    measure(args)


if __name__ == "__main__":
    main()
