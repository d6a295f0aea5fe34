"""`manage.py ctl_status` on a big fleet: wall time of a real subprocess (start-up included) and lines printed.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/llmgw_bench SECRET_KEY=bench \\
        .venv/bin/python bench/ctl_status_bench.py [--nodes 1000] [--models 500] [--runs 5]

It EMPTIES the database named by DATABASE_URL (migrate, then flush), builds
`--nodes` 8-GPU nodes with two ready replicas each over `--models` models (`tests.fleet.bulk_fleet`),
a leader lease, known usage, and a few failed and unplaceable replicas, then
runs `python manage.py ctl_status` (default text, `--check`, `--nodes`,
`--json`) `--runs` times each and prints the median and worst wall time and
the number of lines. The targets: the default text under 60 lines and under 2 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = ([], ["--check"], ["--nodes"], ["--json"])


def build(nodes: int, models: int) -> None:
    import django

    django.setup()
    from datetime import timedelta

    from django.conf import settings
    from django.core.management import call_command
    from django.utils import timezone

    from reconciler.choices import ReplicaState
    from reconciler.models import Lease, Replica
    from tests.fleet import bulk_fleet, make_model, make_replica, watch_usage

    call_command("migrate", verbosity=0)
    call_command("flush", interactive=False, verbosity=0)
    started = time.perf_counter()
    bulk_fleet(nodes, models=models, replicas=2 * nodes)
    now = timezone.now()
    Lease.objects.create(name=settings.LLMGW_LEASE_NAME, owner="bench", epoch=1, expires_at=now.timestamp() + 3600)
    watch_usage(known_since=now - timedelta(hours=2))
    profile = make_model("broken", gpus_per_node=8, min_replicas=0).profiles.get()
    for i in range(20):
        replica = make_replica(profile, state=ReplicaState.FAILED)
        Replica.objects.filter(pk=replica.pk).update(last_error=f"engine exited with status {i % 3}\ntraceback")
    make_replica(profile, state=ReplicaState.PENDING, error="needs 8 free H100-80GB GPUs on one node; none has")
    print(f"built {nodes} nodes in {time.perf_counter() - started:.1f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--models", type=int, default=500, help="models the replicas are spread over")
    args = parser.parse_args()
    if not os.environ.get("DATABASE_URL", "").startswith("postgres"):
        sys.exit("set DATABASE_URL to a PostgreSQL database this bench may empty")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    build(args.nodes, args.models)
    for variant in VARIANTS:
        times, lines = [], 0
        for _ in range(args.runs):
            started = time.perf_counter()
            done = subprocess.run(
                [sys.executable, str(ROOT / "manage.py"), "ctl_status", *variant],
                capture_output=True,
                text=True,
                cwd=ROOT,
            )
            times.append(time.perf_counter() - started)
            if done.returncode not in (0, 2):
                sys.exit(f"ctl_status {' '.join(variant)} failed ({done.returncode}): {done.stderr}")
            lines = len(done.stdout.splitlines())
        name = "ctl_status " + " ".join(variant) if variant else "ctl_status"
        print(
            f"{name:<22} median {statistics.median(times):.2f}s  worst {max(times):.2f}s  {lines} lines"
            + (f"  exit {done.returncode}" if variant == ["--check"] else "")
        )


if __name__ == "__main__":
    main()
