"""LoRA adapters at catalog scale: the endpoint table's build and publish, and the router's /v1/models.

    .venv/bin/python bench/adapters_bench.py [--adapters 1000] [--runs 20] [--requests 2000]

One base model with two READY replicas of 8 adapter slots each, `--adapters` adapters registered on it (with
an alias each), 16 of them loaded (8 per replica):

* **table**: `build_endpoint_table()` then `publish_endpoints()` on the hub (Redis when REDIS_URL is set, else
  the in-process one), `--runs` times, each on a table that changed (one adapter's load moves), so every
  publish is a real one; prints the median and worst, and the table's size;
* **/v1/models**: the router as production serves it (uvicorn, router/serving.py) in its own process, on an
  in-process hub holding that table, and `--requests` sequential GET /v1/models over HTTP on 127.0.0.1 with
  a key that may use everything; prints p50/p99/max.

The database is DATABASE_URL's (PostgreSQL for the figures in docs/benchmarks.md), else a SQLite file in a
temporary folder.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
KEY = "sk-llmgw-bench-0123456789abcdef"


def setup_django(workdir: str) -> None:
    os.environ.setdefault("LLMGW_HOME", workdir)
    os.environ.setdefault("SECRET_KEY", "bench-only")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    import django

    django.setup()


def build_catalog(count: int):
    """The base, its two ready replicas (8 slots each) and `count` adapters, 16 of them loaded."""
    from django.utils import timezone

    from catalog.models import Adapter, Model, Profile
    from inventory.choices import NodeState
    from inventory.models import Node
    from reconciler.choices import ReplicaState, ShardState
    from reconciler.models import AdapterLoad, Lease, Replica, Shard

    for table in (AdapterLoad, Shard, Replica, Adapter, Profile, Model, Node, Lease):
        table.objects.all().delete()
    now = timezone.now()
    base = Model.objects.create(name="base", source="org/base")
    profile = Profile.objects.create(model=base, engine="vllm", gpu_class="H100-80GB", max_adapters=8, max_replicas=2)
    replicas = []
    for i in range(2):
        node = Node.objects.create(name=f"n{i}", address=f"10.0.0.{i + 1}", state=NodeState.READY, last_seen=now)
        replica = Replica.objects.create(
            model=base, profile=profile, state=ReplicaState.READY, endpoint_url=f"http://10.0.0.{i + 1}:8000"
        )
        Shard.objects.create(replica=replica, node=node, port=8000, state=ShardState.READY)
        replicas.append(replica)
    adapters = Adapter.objects.bulk_create(
        Adapter(name=f"ft-{i:04d}", base=base, source=f"org/ft-{i:04d}", aliases=[f"alias-{i:04d}"])
        for i in range(count)
    )
    AdapterLoad.objects.bulk_create(
        AdapterLoad(adapter=a, replica=replicas[i // 8], state="loaded", requested_at=now, loaded_at=now)
        for i, a in enumerate(adapters[:16])
    )
    return adapters, replicas


def bench_table(runs: int, adapters, replicas) -> tuple[float, float, int]:
    """(median ms, worst ms, table bytes) of build + publish, each run on a changed table."""
    import msgspec

    from hub import get_hub
    from reconciler.endpoints import build_endpoint_table
    from reconciler.models import AdapterLoad

    hub = get_hub()
    times = []
    size = 0
    for run in range(runs):
        # One more adapter loaded on the first replica each run: the table changed, the publish is real.
        AdapterLoad.objects.filter(adapter=adapters[16 + run % (len(adapters) - 16)]).delete()
        AdapterLoad.objects.create(
            adapter=adapters[16 + run % (len(adapters) - 16)], replica=replicas[0], state="loaded",
            requested_at=replicas[0].created_at,
        )  # fmt: skip
        started = time.perf_counter()
        table = build_endpoint_table()
        published = hub.publish_endpoints(table)
        times.append((time.perf_counter() - started) * 1000)
        assert published, "the table did not change between runs"
        size = len(msgspec.json.encode(table))
    return statistics.median(times), max(times), size


def serve_router(port: int, workdir: str, count: int) -> None:
    """The router on an in-process hub holding the table of `count` adapters (built in this process's SQLite)."""
    os.environ["DATABASE_URL"] = f"sqlite:///{workdir}/router.sqlite3"
    os.environ.pop("REDIS_URL", None)
    setup_django(workdir)
    from django.conf import settings
    from django.core.management import call_command

    from hub import InProcessHub
    from keys.models import ApiKey
    from reconciler.endpoints import build_endpoint_table
    from router.app import create_app
    from router.serving import GracefulServer, server_config

    call_command("migrate", verbosity=0)
    build_catalog(count)
    ApiKey.issue("bench", key=KEY)
    hub = InProcessHub()
    hub.publish_endpoints(build_endpoint_table())
    GracefulServer(server_config(create_app(hub), port=port, grace=settings.LLMGW_SHUTDOWN_GRACE_SECONDS)).run()


async def bench_models(url: str, requests: int) -> tuple[list[float], int]:
    """Sequential GET /v1/models: latencies (ms) and the number of models listed."""
    import aiohttp

    headers = {"Authorization": f"Bearer {KEY}"}
    latencies = []
    listed = 0
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + 60
        while True:
            try:
                async with session.get(url, headers=headers) as response:
                    if response.status == 200:
                        listed = len((await response.json())["data"])
                        break
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the router did not serve /v1/models within 60 s")
            await asyncio.sleep(0.2)
        for _ in range(requests):
            started = time.perf_counter()
            async with session.get(url, headers=headers) as response:
                await response.read()
                assert response.status == 200
            latencies.append((time.perf_counter() - started) * 1000)
    return latencies, listed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=20, help="table builds and publishes")
    parser.add_argument("--requests", type=int, default=2000, help="GET /v1/models")
    parser.add_argument("--serve-router", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_router:
        return serve_router(args.serve_router, args.workdir, args.adapters)

    workdir = tempfile.mkdtemp(prefix="llmgw-adapters-bench-")
    setup_django(workdir)
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    adapters, replicas = build_catalog(args.adapters)
    median, worst, size = bench_table(args.runs, adapters, replicas)
    hub = "redis" if os.environ.get("REDIS_URL") else "in-process"
    print(f"database: {connection.vendor}, hub: {hub}, adapters: {args.adapters}")
    print(f"table build + publish: median {median:.1f} ms, worst {worst:.1f} ms ({size:,} bytes), {args.runs} runs")

    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "LLMGW_HOME")}
    cmd = [
        sys.executable,
        __file__,
        "--serve-router",
        str(port),
        "--workdir",
        workdir,
        "--adapters",
        str(args.adapters),
    ]
    router = subprocess.Popen(cmd, env=env)
    try:
        latencies, listed = asyncio.run(bench_models(f"http://127.0.0.1:{port}/v1/models", args.requests))
    finally:
        router.terminate()
        router.wait(10)
    latencies.sort()
    p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99) - 1]
    print(f"GET /v1/models ({listed:,} listed): p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {latencies[-1]:.2f} ms")


if __name__ == "__main__":
    main()
