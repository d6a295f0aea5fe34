"""Reconcile tick cost against fleet size: wall time and query count per tick.

    .venv/bin/python bench/tick_bench.py [--nodes 10,100,500] [--ticks 20]

For each fleet size it builds, in a fresh SQLite file (or the database named by
DATABASE_URL), that many 8-GPU nodes, one single-GPU model per two nodes with
min_replicas=4, then runs one placing tick and `--ticks` steady ticks, and
prints the median steady tick time and the query counts. The query count must
not grow with the fleet (CONVENTIONS: a tick runs a fixed number of queries).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="10,100,500", help="comma-separated fleet sizes")
    parser.add_argument("--ticks", type=int, default=20, help="steady ticks measured per size")
    args = parser.parse_args()
    sizes = [int(n) for n in args.nodes.split(",")]

    os.environ.setdefault("LLMGW_VAR_DIR", tempfile.mkdtemp(prefix="llmgw-tick-bench-"))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from catalog.choices import Engine
    from catalog.models import Model, Profile
    from inventory.choices import NodeState
    from inventory.models import GPU, Node
    from reconciler.lease import Leadership
    from reconciler.models import GPUAssignment, Lease, Replica, Shard
    from reconciler.tick import tick

    call_command("migrate", verbosity=0)
    print(f"database: {connection.vendor}")
    leadership = Leadership(ttl=600)
    print(
        f"{'nodes':>6} {'GPUs':>6} {'replicas':>8} {'placing ms':>11} {'queries':>8} {'steady ms (p50)':>16} {'queries':>8}"
    )
    for size in sizes:
        # The lease too: a previous run's leader would hold it for its TTL and this run would not place.
        for table in (GPUAssignment, Shard, Replica, Profile, Model, GPU, Node, Lease):
            table.objects.all().delete()
        now = timezone.now()
        nodes = Node.objects.bulk_create(
            Node(
                name=f"n{i:04d}",
                address=f"10.0.{i // 250}.{i % 250}",
                fabric=f"ib-{i % 4}",
                state=NodeState.READY,
                last_seen=now,
            )
            for i in range(size)
        )
        GPU.objects.bulk_create(
            GPU(node=node, index=g, uuid=f"{node.name}-{g}", gpu_class="H100-80GB", memory_mb=81920)
            for node in nodes
            for g in range(8)
        )
        for m in range(max(1, size // 2)):
            model = Model.objects.create(name=f"model-{m}", source=f"org/model-{m}")
            Profile.objects.create(
                model=model, engine=Engine.MOCK, gpu_class="H100-80GB", min_replicas=4, max_replicas=4
            )
        with CaptureQueriesContext(connection) as placing_queries:
            started = time.perf_counter()
            tick(leadership=leadership)
            placing_ms = (time.perf_counter() - started) * 1000
        steady, steady_queries = [], 0
        for _ in range(args.ticks):
            with CaptureQueriesContext(connection) as ctx:
                started = time.perf_counter()
                tick(leadership=leadership)
                steady.append((time.perf_counter() - started) * 1000)
            steady_queries = len(ctx)
        replicas = Replica.objects.count()
        print(
            f"{size:>6} {size * 8:>6} {replicas:>8} {placing_ms:>11.1f} {len(placing_queries):>8} "
            f"{statistics.median(steady):>16.1f} {steady_queries:>8}"
        )


if __name__ == "__main__":
    main()
