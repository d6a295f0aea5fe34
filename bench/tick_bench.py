"""Reconcile tick cost against fleet size: wall time and query count per tick.

    .venv/bin/python bench/tick_bench.py [--nodes 10,100,500] [--ticks 20] [--scenario placing|pressure]
    .venv/bin/python bench/tick_bench.py --compare REV [--rounds 4] [--nodes 1000] [--ticks 10]

For each fleet size it builds, in a fresh SQLite file (or the database named by
DATABASE_URL), that many 8-GPU nodes, then:

* `placing`: one single-GPU model per two nodes with min_replicas=4; one
  placing tick, then `--ticks` steady ticks (the agents have acknowledged
  the starts, their engines are still starting);
* `pressure`: a full fleet — two ready 4-GPU replicas on every node (so 2,000
  replicas at 1,000 nodes), idle for known times — and a queue of
  `--waiting` 8-GPU models asked for before every tick: the first tick evicts
  (two victims per waiting model), the steady ticks that follow re-read the
  occupants while the victims drain (no agents answer here).

`--adapters N` registers N LoRA adapters on the pressure fleet's first model (8
slots per replica) with its first two replicas' slots full, recently used.

`--compare REV` runs this checkout's bench and REV's own (`git archive`d to a
temporary folder, run with this interpreter), `--rounds` times each in turn,
alternating which goes first, on one machine and one database server (a fresh
database per run): the placing scenario, one size.

It prints the median steady tick time and the query counts
(TICK_BENCH_QUERIES=1 lists a steady tick's queries, TICK_BENCH_PROFILE=1
profiles one, TICK_BENCH_PROFILE=placing the placing tick, TICK_BENCH_STEPS=1
times each step of the placing tick and of the last steady tick). The query count must
not grow with the fleet (DESIGN "Reconcile tick": a constant number of queries).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
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
    parser.add_argument("--scenario", choices=("placing", "pressure"), default="placing")
    parser.add_argument("--waiting", type=int, default=20, help="pressure: 8-GPU models waiting for room")
    parser.add_argument(
        "--sleeping", type=float, default=0.0, help="pressure: the share of the replicas asleep (the hibernate tier)"
    )
    parser.add_argument(
        "--adapters",
        type=int,
        default=0,
        help="pressure: LoRA adapters registered on the first model, 8 slots per replica, its two first replicas full",
    )
    parser.add_argument("--compare", metavar="REV", help="run REV's own bench in turn with this one's")
    parser.add_argument("--rounds", type=int, default=4, help="--compare: runs of each side")
    args = parser.parse_args()
    if args.compare:
        compare(args.compare, args.rounds, args.nodes, args.ticks)
        return
    sizes = [int(n) for n in args.nodes.split(",")]

    os.environ.setdefault("LLMGW_HOME", tempfile.mkdtemp(prefix="llmgw-tick-bench-"))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    from datetime import timedelta

    import django

    django.setup()
    from asgiref.sync import async_to_sync
    from django.core.management import call_command
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from catalog.choices import Engine
    from catalog.models import Model, Profile
    from hub import UsageReport, get_hub
    from inventory.models import GPU, Node
    from reconciler.choices import ReplicaState
    from reconciler.leadership.lease import Leadership
    from reconciler.models import GPUAssignment, Lease, ModelLoad, PendingCommand, Replica, Shard, UsageWatch
    from reconciler.tick import tick

    hub = get_hub()
    step_times = _time_steps() if os.environ.get("TICK_BENCH_STEPS") else None

    def one_tick():
        # A router reporting keeps usage known, so the tick may evict; the waiting queue asks again.
        async_to_sync(hub.report_usage)(UsageReport(router="bench", ttl=60))
        for name in waiting:
            async_to_sync(hub.request_activation)(name)
        report = tick(leadership=leadership)
        if not report.leader or not report.usage_known:
            print(f"       tick: leader={report.leader} usage known={report.usage_known} {report.usage_unknown_reason}")

    waiting: list[str] = []

    call_command("migrate", verbosity=0)
    print(f"database: {connection.vendor}")
    leadership = Leadership(ttl=600)
    print(
        f"{'nodes':>6} {'GPUs':>6} {'replicas':>8} {'placing ms':>11} {'queries':>8} {'steady ms (p50)':>16} {'queries':>8}"
    )
    for size in sizes:
        # The lease too: a previous run's leader would hold it for its TTL and this run would not place.
        for table in (GPUAssignment, Shard, Replica, ModelLoad, Profile, Model, GPU, Node, Lease, UsageWatch):
            table.objects.all().delete()
        now = timezone.now()
        nodes = build_nodes(size, now)
        if args.scenario == "placing":
            waiting = []
            for m in range(max(1, size // 2)):
                model = Model.objects.create(name=f"model-{m}", source=f"org/model-{m}")
                Profile.objects.create(
                    model=model, engine=Engine.MOCK, gpu_class="H100-80GB", min_replicas=4, max_replicas=4
                )
        else:
            waiting = full_fleet(nodes, now, args.waiting, args.sleeping)
            if args.adapters:
                add_adapters(args.adapters, now)
        # Usage has been known for a while (a router has reported all along): the tick may stop and evict.
        UsageWatch.objects.create(name="fleet", known_since=now - timedelta(hours=1))
        # Building a big fleet takes longer than the heartbeat window: the nodes have just been heard from.
        Node.objects.update(last_seen=timezone.now())
        profile = os.environ.get("TICK_BENCH_PROFILE", "")
        PendingCommand.objects.all().delete()  # a previous run's starts would be sent again by this one's ticks
        with CaptureQueriesContext(connection) as placing_queries:
            started = time.perf_counter()
            if profile == "placing":
                import cProfile
                import pstats

                profiler = cProfile.Profile()
                profiler.runcall(one_tick)
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(60)
            else:
                one_tick()
            placing_ms = (time.perf_counter() - started) * 1000
        if step_times is not None:
            _print_steps("placing tick", step_times)
        # The agents acknowledge what they were sent, as live ones do at once: a steady tick re-sends nothing.
        PendingCommand.objects.all().delete()
        if profile and profile != "placing":
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.runcall(one_tick)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)
        steady, steady_queries = [], 0
        for _ in range(args.ticks):
            if step_times is not None:
                step_times[0].clear()
                step_times[1].clear()
            with CaptureQueriesContext(connection) as ctx:
                started = time.perf_counter()
                one_tick()
                steady.append((time.perf_counter() - started) * 1000)
            steady_queries = len(ctx)
            if os.environ.get("TICK_BENCH_QUERIES"):
                print("\n".join(q["sql"][:160] for q in ctx.captured_queries))
        if step_times is not None:
            _print_steps("last steady tick", step_times)
        replicas = Replica.objects.count()
        if args.scenario == "pressure":
            stopping = Replica.objects.filter(state=ReplicaState.STOPPING).count()
            print(f"       evicted {stopping} replicas for {len(waiting)} waiting models")
        print(
            f"{size:>6} {size * 8:>6} {replicas:>8} {placing_ms:>11.1f} {len(placing_queries):>8} "
            f"{statistics.median(steady):>16.1f} {steady_queries:>8}"
        )


def _time_steps() -> tuple[dict[str, float], dict[str, int]]:
    """Time every step the tick runs through `telemetry.Steps` (and the publish after commit), in ms, and count
    its queries (while a CaptureQueriesContext is open)."""
    from django.db import connection

    import telemetry

    times: dict[str, float] = {}
    plain = telemetry.Steps.run

    def timed(self, name, step, /, *args, **kwargs):
        started, queries = time.perf_counter(), len(connection.queries)
        try:
            return plain(self, name, step, *args, **kwargs)
        finally:
            times[name] = times.get(name, 0.0) + (time.perf_counter() - started) * 1000
            counts[name] = counts.get(name, 0) + len(connection.queries) - queries

    counts: dict[str, int] = {}
    telemetry.Steps.run = timed
    return times, counts


def _print_steps(title: str, steps: tuple[dict[str, float], dict[str, int]]) -> None:
    times, counts = steps
    listed = sorted(times.items(), key=lambda i: -i[1])
    print(f"       {title} (ms, queries): " + ", ".join(f"{name} {ms:.1f} {counts[name]}q" for name, ms in listed))
    times.clear()
    counts.clear()


def add_adapters(count: int, now) -> None:
    """`count` adapters on model-0 (8 slots per replica), 8 loaded on each of its first two replicas, used now."""
    from catalog.models import Adapter, Model, Profile
    from reconciler.choices import AdapterLoadState
    from reconciler.models import AdapterLoad, Replica

    base = Model.objects.get(name="model-0")
    Profile.objects.filter(model=base).update(engine="vllm", max_adapters=8)
    adapters = Adapter.objects.bulk_create(
        Adapter(name=f"ft-{i:04d}", base=base, source=f"org/ft-{i:04d}") for i in range(count)
    )
    replicas = list(Replica.objects.filter(model=base).order_by("pk")[:2])
    AdapterLoad.objects.bulk_create(
        AdapterLoad(
            adapter=adapter, replica=replicas[i // 8], state=AdapterLoadState.LOADED, requested_at=now,
            loaded_at=now, last_used=now,
        )
        for i, adapter in enumerate(adapters[:16])
    )  # fmt: skip


def build_nodes(size: int, now):
    """`size` ready 8×H100-80GB nodes (`n0000`…) on four fabrics, in two bulk inserts."""
    from inventory.choices import NodeState
    from inventory.models import GPU, Node

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
    return nodes


def full_fleet(nodes, now, waiting_models: int, sleeping: float = 0.0) -> list[str]:
    """Two ready 4-GPU replicas on every node (one model per two nodes, four replicas each), all known idle,
    and the names of the 8-GPU models that will wait for room. A `sleeping` share of the replicas is asleep
    instead (`_put_to_sleep`)."""
    from datetime import timedelta

    from catalog.choices import Engine
    from catalog.models import Model, Profile
    from inventory.models import GPU
    from reconciler.choices import ReplicaState, ShardState
    from reconciler.models import GPUAssignment, Replica, Shard

    profiles = []
    for m in range(len(nodes) // 2):
        model = Model.objects.create(name=f"model-{m}", source=f"org/model-{m}")
        profiles.append(
            Profile.objects.create(
                model=model, engine=Engine.MOCK, gpu_class="H100-80GB", gpus_per_node=4, max_replicas=4,
                idle_timeout_seconds=0,
            )
        )  # fmt: skip
    replicas = Replica.objects.bulk_create(
        Replica(
            model_id=profiles[i // 4].model_id,
            profile=profiles[i // 4],
            state=ReplicaState.READY,
            endpoint_url=f"http://10.0.0.1:{20000 + i}",
            ready_at=now - timedelta(hours=2),
            last_used=now - timedelta(seconds=600 + i),
        )
        for i in range(len(profiles) * 4)
    )
    shards = Shard.objects.bulk_create(
        Shard(replica=replica, node=nodes[i // 2], rank=0, port=20000 + i % 2, state=ShardState.READY)
        for i, replica in enumerate(replicas)
    )
    gpus = {(g.node_id, g.index): g.pk for g in GPU.objects.all()}
    GPUAssignment.objects.bulk_create(
        GPUAssignment(gpu_id=gpus[(shard.node_id, (i % 2) * 4 + g)], shard=shard)
        for i, shard in enumerate(shards)
        for g in range(4)
    )
    if sleeping > 0:
        _put_to_sleep(replicas, sleeping)
    waiting = []
    for w in range(waiting_models):
        model = Model.objects.create(name=f"waiting-{w}", source=f"org/waiting-{w}")
        Profile.objects.create(model=model, engine=Engine.MOCK, gpu_class="H100-80GB", gpus_per_node=8)
        waiting.append(model.name)
    return waiting


def _put_to_sleep(replicas, sleeping: float) -> None:
    """Put a `sleeping` share of `replicas` (every other one at 0.5) to sleep, as the hibernate tier leaves them
    once their engines are asleep: their GPUs free, their engines and ports kept."""
    from reconciler.choices import ReplicaState, ShardState
    from reconciler.models import GPUAssignment, Replica, Shard

    every = max(1, round(1 / sleeping))
    asleep = [r.pk for i, r in enumerate(replicas) if i % every == 0]
    Replica.objects.filter(pk__in=asleep).update(state=ReplicaState.SLEEPING, endpoint_url="", sleeping_level=2)
    Shard.objects.filter(replica_id__in=asleep).update(state=ShardState.SLEEPING)
    GPUAssignment.objects.filter(shard__replica_id__in=asleep).update(awake=False)


ROW = re.compile(r"^\s*(\d+)\s+\d+\s+(\d+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+(\d+)\s*$", re.M)


def compare(rev: str, rounds: int, nodes: str, ticks: int) -> None:
    """This checkout against REV, each running its own bench in turn (module docstring)."""
    size = nodes.split(",")[0]
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True)
    with tempfile.TemporaryDirectory(prefix="llmgw-tick-compare-") as tmp:
        other = Path(tmp) / "rev"
        other.mkdir()
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(other)], input=archive, check=True)
        sides = {"this checkout": (ROOT, "head"), f"{rev} ({sha.stdout.strip()})": (other, "rev")}
        results: dict[str, list[tuple[float, int, float, int]]] = {name: [] for name in sides}
        for round_ in range(rounds):
            order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
            for name in order:
                root, suffix = sides[name]
                results[name].append(_run_side(root, suffix, size, ticks, Path(tmp)))
                print(f"round {round_ + 1} {name}: {results[name][-1]}", flush=True)
    print(f"\n{size} nodes, placing scenario, {rounds} runs each in turn (medians; queries per tick)")
    print(f"{'side':<28} {'placing ms':>11} {'queries':>8} {'steady ms':>10} {'queries':>8}")
    medians = {}
    for name, runs in results.items():
        placing, placing_q, steady, steady_q = (statistics.median(column) for column in zip(*runs, strict=True))
        medians[name] = (placing, steady)
        print(f"{name:<28} {placing:>11.1f} {placing_q:>8.0f} {steady:>10.1f} {steady_q:>8.0f}")
    (head_placing, head_steady), (rev_placing, rev_steady) = medians.values()
    print(f"{'ratio':<28} {head_placing / rev_placing:>11.2f} {'':>8} {head_steady / rev_steady:>10.2f}")


def _run_side(root: Path, suffix: str, size: str, ticks: int, tmp: Path) -> tuple[float, int, float, int]:
    """One run of the bench in `root` on its own database; (placing ms, queries, steady ms, queries)."""
    env = dict(os.environ, LLMGW_HOME=tempfile.mkdtemp(dir=tmp), SECRET_KEY=os.environ.get("SECRET_KEY", "bench"))
    if os.environ.get("DATABASE_URL"):
        env["DATABASE_URL"] = _side_database(os.environ["DATABASE_URL"], suffix)
    command = [sys.executable, str(root / "bench" / "tick_bench.py"), "--nodes", size, "--ticks", str(ticks)]
    out = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, check=True).stdout
    match = ROW.search(out)
    if match is None:
        raise SystemExit(f"no result row in the output of {root}:\n{out}")
    _nodes, replicas, placing, placing_q, steady, steady_q = match.groups()
    if int(replicas) == 0:
        raise SystemExit(f"{root}'s bench placed nothing:\n{out}")
    return float(placing), int(placing_q), float(steady), int(steady_q)


def _side_database(url: str, suffix: str) -> str:
    """`url` with `_<suffix>` after its database name, created afresh for each run: each side migrates its own, and
    an older bench leaves its lease row behind (the next run would not lead, so would place nothing)."""
    import psycopg

    base, _, name = url.rpartition("/")
    side = f"{name}_{suffix}"
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{side}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{side}"')
    return f"{base}/{side}"


if __name__ == "__main__":
    main()
