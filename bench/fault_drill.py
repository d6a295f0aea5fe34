"""The fault drill: run the distributed stack, load it, inject each fault in turn, print the verdicts.

    .venv/bin/python bench/fault_drill.py [--faults all|agent-kill,port-busy,...] [--steady-seconds 60]

It creates a private PostgreSQL cluster and a private Redis server (never the
shared ones), starts two control planes, two routers, Celery beat and two
workers and three agents with simulated GPUs from this checkout, keeps chat
requests flowing through both routers, then injects each fault, waits for the
stack to recover and prints one table: fault, client errors / requests that
the fault could affect, recovery time, what must hold, verdict. GPUs held
twice, profiles above max and orphan engines are counted after every fault.
Thresholds are shortened so the drill runs in minutes (see SETTINGS). Exit
status 0 only if every row passes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from drill.stack import PrivatePostgres, PrivateRedis, Stack, wait_for  # noqa: E402

KEY = "sk-llmgw-fault-drill-0123456789"
# Short thresholds, so faults resolve in seconds; the rules are the same as with the defaults.
SETTINGS = {
    "LLMGW_TICK_SECONDS": "1",
    "LLMGW_LEASE_TTL_SECONDS": "5",
    "LLMGW_HEARTBEAT_SECONDS": "1",
    "LLMGW_UNREACHABLE_AFTER_SECONDS": "3",
    "LLMGW_LOST_AFTER_SECONDS": "8",
    "LLMGW_START_RESEND_SECONDS": "3",
    "LLMGW_ROUTER_POLL_SECONDS": "1",
    "LLMGW_ACTIVATION_TIMEOUT_SECONDS": "30",
}
NODES = [("n1", "4xH100-80GB"), ("n2", "4xH100-80GB"), ("n3", "4xH100-80GB")]
MODELS = [("drill-a", 2), ("drill-b", 1)]  # (name, replicas)
FAULTS = [
    "agent-kill",
    "leader-worker-kill",
    "leader-pause",
    "steady",
    "redis-restart",
    "postgres-15",
    "postgres-60",
    "control-plane-kill",
    "control-plane-term",
    "port-busy",
    "engine-kill-mid-stream",
]


def _django(stack: Stack) -> None:
    os.environ.update(stack.env("drill"))
    os.environ["DJANGO_SETTINGS_MODULE"] = "llmgw_site.settings"
    import django

    django.setup()


def build(workdir: Path, workers: int) -> Stack:
    """Start the private servers and every process; return once every replica is ready."""
    stack = Stack(workdir, dict(SETTINGS))
    stack.pg, stack.redis = PrivatePostgres(workdir), PrivateRedis(workdir)
    stack.pg.init()
    stack.redis.start()
    stack.redis_url = stack.redis.url
    (workdir / "var").mkdir()
    _django(stack)
    from django.core.management import call_command

    from catalog.choices import Engine
    from catalog.models import Model, Profile
    from inventory.services import enrol_node
    from keys.models import ApiKey

    call_command("migrate", verbosity=0)
    ApiKey.issue("fault drill", KEY)
    for name, replicas in MODELS:
        model = Model.objects.create(name=name, source=f"drill/{name}")
        Profile.objects.create(
            model=model, engine=Engine.MOCK, gpu_class="H100-80GB", min_replicas=replicas, max_replicas=replicas
        )
    tokens = {name: enrol_node(name, address="127.0.0.1", fabric="ib-a")[1] for name, _ in NODES}

    stack.control_planes = [stack.control_plane(i).start() for i in (1, 2)]
    stack.routers = [stack.router(i).start() for i in (1, 2)]
    stack.workers = [stack.worker(i).start() for i in range(1, workers + 1)]
    stack.beats = [stack.beat(i).start() for i in (1, 2)]
    import httpx

    for name in ("cp1", "cp2", "router1", "router2"):
        path = "/metrics" if name.startswith("cp") else "/health"
        url = f"http://127.0.0.1:{stack.ports[name]}{path}"
        wait_for(lambda url=url: httpx.get(url, timeout=1).status_code == 200, 60, 0.2, f"{name} serving")
    for name, gpus in NODES:
        stack.agents[name] = stack.agent(name, tokens[name], gpus, "ib-a").start()
    return stack


def table(rows) -> str:
    headers = ["fault", "errors / requests", "recovery", "must hold", "GPUs x2", "above max", "orphans", "verdict"]
    lines = [
        [r.fault, f"{r.errors} / {r.requests}" if r.requests is not None else "-", r.recovery + (f" ({r.note})" if r.note else ""), r.must_hold,
         str(r.double), str(r.above_max), str(r.orphans), r.verdict]
        for r in rows
    ]  # fmt: skip
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default="all", help=f"comma-separated, from: {', '.join(FAULTS)}")
    parser.add_argument("--steady-seconds", type=float, default=60.0, help="length of each steady run")
    parser.add_argument("--steady-workers", default="1,2,4", help="worker counts for the steady runs")
    parser.add_argument("--clients", type=int, default=10, help="concurrent clients of the load")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs) afterwards")
    args = parser.parse_args()
    chosen = FAULTS if args.faults == "all" else [f.strip() for f in args.faults.split(",")]
    unknown = sorted(set(chosen) - set(FAULTS))
    if unknown:
        parser.error(f"unknown fault(s): {', '.join(unknown)}; choose from {', '.join(FAULTS)}")

    workdir = Path(tempfile.mkdtemp(prefix="llmgw-drill-"))
    os.chmod(workdir, 0o755)  # the private PostgreSQL runs as another user
    print(f"work directory: {workdir}", flush=True)
    stack = None
    rows = []
    try:
        stack = build(workdir, workers=2)
        from drill.faults import Faults
        from drill.load import Load
        from drill.monitor import LeaseMonitor

        monitor = LeaseMonitor().start()
        routers = [f"http://127.0.0.1:{stack.ports[r]}" for r in ("router1", "router2")]
        faults = Faults(stack, Load(routers, [m for m, _ in MODELS], KEY, args.clients), monitor,
                        tick=1.0, ttl=5.0, lost=8.0)  # fmt: skip
        faults._settle(120)
        faults.load.start()
        time.sleep(3)
        runs = {
            "agent-kill": faults.agent_kill,
            "leader-worker-kill": faults.leader_worker_kill,
            "leader-pause": faults.leader_pause_in_tick,
            "redis-restart": faults.redis_restart,
            "postgres-15": lambda: faults.postgres_stop(15),
            "postgres-60": lambda: faults.postgres_stop(60),
            "control-plane-kill": faults.control_plane_kill,
            "control-plane-term": faults.control_plane_term,
            "port-busy": faults.port_busy,
            "engine-kill-mid-stream": faults.engine_kill_mid_stream,
        }
        for name in chosen:
            if name == "steady":
                for count in (int(n) for n in args.steady_workers.split(",")):
                    rows.append(faults.steady(count, args.steady_seconds))
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
                continue
            print(f"-- {name}", flush=True)
            rows.append(runs[name]())
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            faults._settle(120)
        faults.load.stop()
        monitor.stop()
    finally:
        if stack is not None:
            stack.stop_all()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(table(rows))
    return 0 if rows and all(r.verdict == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
