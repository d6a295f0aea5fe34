"""`plan` ("Will it fit?") on a big fleet: wall time and query count per answer.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/llmgw_bench SECRET_KEY=bench \\
        .venv/bin/python bench/plan_bench.py [--nodes 1000] [--runs 20]

It EMPTIES the database named by DATABASE_URL (migrate, then delete), builds
`--nodes` 8×H100 nodes full of known-idle 4-GPU replicas with the reconcile
tick benchmark's builders (`tick_bench.build_nodes`, `tick_bench.full_fleet`:
two replicas per node, 2,000 at 1,000 nodes), frees one replica's 4 GPUs on the
last node, and times `reconciler.planner.what_if.plan_request` (what `manage.py plan`
and `POST /api/v1/plan` call) `--runs` times for each case:

* `fits`: a 4-GPU model (the freed GPUs);
* `fits_after_stopping`: an 8-GPU model (the fewest idle replicas to stop);
* `does_not_fit`: an 8-GPU model of a priority below every running one
  (nothing may be stopped for it: the eviction path runs in full and finds nothing);
* `all three`: the three in one request, planned cumulatively;

and the three through `POST /api/v1/plan` (a staff session, JSON in and out).
It prints the median and worst milliseconds and the queries of each. Target: < 2 s per answer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TARGET_MS = 2000.0


def entry(name: str, gpus: int, priority: int = 0) -> dict:
    """A catalog-format entry: Llama-3.1-8B's size in the catalog's words, `gpus` H100s per replica."""
    size = {"parameters_billions": 8.0, "dtype": "bfloat16", "layers": 32, "kv_heads": 8, "head_dim": 128}
    profile = {"gpu_class": "H100-80GB", "gpus_per_node": gpus, "min_replicas": 0, "priority": priority}
    return {"name": name, "source": f"org/{name}", **size, "profiles": [{**profile, "max_model_len": 8192}]}


CASES = {
    "fits": [entry("fits-4gpu", 4)],
    "fits_after_stopping": [entry("stop-8gpu", 8)],
    "does_not_fit": [entry("low-8gpu", 8, priority=-1)],
    "all three": [entry("fits-4gpu", 4), entry("stop-8gpu", 8), entry("low-8gpu", 8, priority=-1)],
}


def build(size: int) -> None:
    from datetime import timedelta

    from django.core.management import call_command
    from django.utils import timezone
    from tick_bench import build_nodes, full_fleet

    from catalog.models import Model
    from inventory.models import Node
    from reconciler.models import Lease, Replica, UsageWatch

    call_command("migrate", verbosity=0)
    for table in (Replica, Model, Node, Lease, UsageWatch):
        table.objects.all().delete()
    now = timezone.now()
    nodes = build_nodes(size, now)
    full_fleet(nodes, now, waiting_models=0)
    Replica.objects.filter(pk=Replica.objects.filter(shards__node=nodes[-1]).order_by("pk")[0].pk).delete()
    UsageWatch.objects.create(name="fleet", known_since=now - timedelta(hours=1))


def measure(run, runs: int) -> tuple[list[float], int, object]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    times, queries, result = [], 0, None
    for _ in range(runs):
        with CaptureQueriesContext(connection) as ctx:
            started = time.perf_counter()
            result = run()
            times.append((time.perf_counter() - started) * 1000)
        queries = len(ctx)
    return times, queries, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("LLMGW_HOME", tempfile.mkdtemp(prefix="llmgw-plan-bench-"))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client

    from reconciler.models import Replica
    from reconciler.planner.what_if import plan_request

    settings.ALLOWED_HOSTS = ["*"]
    build(args.nodes)
    print(f"database: {connection.vendor}; {args.nodes} nodes, {Replica.objects.count()} ready replicas")
    print(f"{'case':<22} {'verdicts':<42} {'median ms':>10} {'max ms':>8} {'queries':>8}")
    for case, entries in CASES.items():
        times, queries, answer = measure(lambda e=entries: plan_request({"models": e}), args.runs)
        verdicts = ",".join(str(m.verdict) for m in answer.models)
        print(f"{case:<22} {verdicts:<42} {statistics.median(times):>10.1f} {max(times):>8.1f} {queries:>8}")
    user = get_user_model().objects.create_user(f"bench-{time.time_ns()}", password="pw", is_staff=True)
    client = Client()
    client.force_login(user)
    body = json.dumps({"models": CASES["all three"]})
    times, queries, response = measure(
        lambda: client.post("/api/v1/plan", body, content_type="application/json"), args.runs
    )
    verdicts = ",".join(m["verdict"] for m in response.json()["models"])
    print(f"{'POST /api/v1/plan':<22} {verdicts:<42} {statistics.median(times):>10.1f} {max(times):>8.1f} {queries:>8}")
    print(f"target: < {TARGET_MS:.0f} ms per answer")


if __name__ == "__main__":
    main()
