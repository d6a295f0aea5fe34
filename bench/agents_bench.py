"""Agents at fleet scale: one control-plane process, N agents, one burst of commands to every node.

    .venv/bin/python bench/agents_bench.py [--nodes 100,250,500,1000] [--steady 10]
        [--database postgres://postgres@127.0.0.1:5432/llmgw_agents_bench] [--redis redis://127.0.0.1:6379/11]
        [--code DIR]

For each fleet size, on a PostgreSQL database of its own (dropped and created
by the bench) and an emptied Redis database:

1. enrols N nodes and starts ONE control-plane process: uvicorn serving the
   project's ASGI app (agent consumer at /agent/ws, Redis channel layer);
2. starts N agents in this process: agent.runtime.Agent itself, with 8 fake
   GPUs each and no engines, so they speak (and acknowledge) exactly as a node does,
   and times until every node's `hello` is recorded (READY, with the agent's version it reports);
3. measures the control plane's CPU over `--steady` seconds of heartbeats;
4. plays one tick's burst: a stop_shard to every node (cheap for the agent:
   it answers at once, no engine) through reconciler.outbox, committed in one
   transaction as a tick does, then sends unacknowledged ones again every tick
   interval as the tick does (reconciler.commands), until all are acknowledged;
5. disconnects every agent and counts group members left in Redis.

It prints: hellos recorded (s), CP CPU % and RSS during the steady window,
delivery p50/p99 (the burst's commit to the agent reading the frame), commands
received on the first send and in all, time until all were acknowledged, and
errors: HTTP 500 handshakes, channel-full sends, leaked group members.

`--code DIR` runs the same scenario against another checkout of the project
(e.g. an older commit, to compare); one without acknowledgements skips step 4's
resends.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="100,250,500,1000", help="comma-separated fleet sizes")
    parser.add_argument("--steady", type=float, default=10.0, help="seconds of heartbeats measured for CPU")
    parser.add_argument("--heartbeat", type=float, default=5.0, help="agents' heartbeat interval (s)")
    parser.add_argument("--database", default="postgres://postgres@127.0.0.1:5432/llmgw_agents_bench")
    parser.add_argument("--redis", default=os.environ.get("REDIS_TEST_URL", "redis://127.0.0.1:6379/11"))
    parser.add_argument("--code", default=str(HERE), help="checkout of the project to run (default: this one)")
    parser.add_argument("--port", type=int, default=18431)
    args = parser.parse_args()
    try:
        args.sizes = [int(n) for n in args.nodes.split(",")]
    except ValueError:
        parser.error(f"--nodes must be comma-separated numbers, got {args.nodes!r}")
    return args


def recreate_database(url: str) -> None:
    import psycopg

    base, name = url.rsplit("/", 1)
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Counter(logging.Handler):
    """Counts log records matching a test, e.g. handshakes answered 500 or sends refused as full."""

    def __init__(self, match) -> None:
        super().__init__()
        self.match, self.count = match, 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.match(record):
            self.count += 1


class AgentFleet:
    """N real agents (fake GPUs, no engines) on an event loop in a thread of their own."""

    def __init__(self, uri: str, tokens: dict[str, str], heartbeat: float) -> None:
        from agent.gpus.discovery import parse_fake_gpus
        from agent.options import AgentOptions
        from agent.runtime import Agent

        fleet = self
        self.received: dict[str, list[float]] = {name: [] for name in tokens}

        class TimedAgent(Agent):
            async def _receive(self, raw):
                fleet.received[self.node].append(time.perf_counter())
                await super()._receive(raw)

        self.loop = asyncio.new_event_loop()
        self.agents = [
            TimedAgent(
                AgentOptions(
                    [uri], name, token, parse_fake_gpus("8xH100-80GB", name), address=name, heartbeat_seconds=heartbeat
                )
            )
            for name, token in tokens.items()
        ]
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        """Every agent connects now."""
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main():
            results = await asyncio.gather(*(a.run() for a in self.agents), return_exceptions=True)
            for error in {repr(r) for r in results if isinstance(r, BaseException)}:
                print(f"    an agent ended with {error}", flush=True)

        self.loop.run_until_complete(main())

    def stop(self) -> None:
        """Shut every agent down (their streams close) and wait for the loop to end."""
        if not self.thread.is_alive():
            return

        async def shutdown():
            await asyncio.gather(*(a.shutdown() for a in self.agents), return_exceptions=True)

        # The loop ends when the agents' run() do, which may be before this coroutine reports back.
        asyncio.run_coroutine_threadsafe(shutdown(), self.loop)
        self.thread.join(60)
        if self.thread.is_alive():
            raise SystemExit("the agents did not shut down within 60 s")


def main() -> None:
    args = parse_args()
    code = Path(args.code).resolve()
    sys.path.insert(0, str(code))
    env = {
        **os.environ,
        "DATABASE_URL": args.database,
        "REDIS_URL": args.redis,
        "SECRET_KEY": "bench-only",
        "LLMGW_HOME": tempfile.mkdtemp(prefix="llmgw-agents-bench-"),
        "DJANGO_SETTINGS_MODULE": "llmgw_site.settings",
        "LOG_LEVEL": "WARNING",
    }
    os.environ.update(env)
    recreate_database(args.database)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=code, env=env, check=True)

    import django

    django.setup()
    logging.getLogger().setLevel(logging.WARNING)
    rows = [run_size(args, code, env, n) for n in args.sizes]
    print()
    print(
        "| N | all hellos recorded | CP CPU | CP RSS | delivery p50 / p99 | received (first send / in all) "
        "| all acknowledged | errors (500 handshakes / channel full / leaked members) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)


def run_size(args, code: Path, env: dict, n: int) -> str:
    import redis
    from django.db import transaction

    from hub.credentials import hash_secret
    from inventory.choices import NodeState
    from inventory.models import Node, NodeCredential
    from reconciler.outbox import Outbox

    try:
        from reconciler.commands import resend_unacknowledged
        from reconciler.models import PendingCommand
    except ImportError:  # a checkout from before acknowledgements
        resend_unacknowledged = PendingCommand = None

    print(f"--- {n} agents", flush=True)
    Node.objects.all().delete()
    if PendingCommand is not None:
        PendingCommand.objects.all().delete()
    redis.Redis.from_url(args.redis).flushdb()
    nodes = Node.objects.bulk_create(Node(name=f"bench-{i:05d}") for i in range(n))
    tokens = {node.name: f"bench-token-{node.name}-{os.urandom(8).hex()}" for node in nodes}
    NodeCredential.objects.bulk_create(
        NodeCredential(node=node, token_hash=hash_secret(tokens[node.name]), prefix=tokens[node.name][:16])
        for node in nodes
    )

    with socket.socket() as sock:
        if sock.connect_ex(("127.0.0.1", args.port)) == 0:
            raise SystemExit(f"something already listens on port {args.port}; choose another with --port")
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "llmgw_site.asgi:application", "--host", "127.0.0.1",
         "--port", str(args.port), "--no-access-log", "--log-level", "warning", "--backlog", "4096"],
        cwd=code, env=env,
    )  # fmt: skip
    handshakes_500 = Counter(lambda r: "answered HTTP" in r.getMessage() and " 500 " in r.getMessage())
    full = Counter(lambda r: r.levelno >= logging.ERROR and "could not send" in r.getMessage())
    logging.getLogger("agent.link").addHandler(handshakes_500)
    logging.getLogger("reconciler.outbox").addHandler(full)
    fleet = None
    try:
        wait_for_port(args.port, server)
        # Built before the clock starts: making a thousand agents (HTTP clients, GPUs) is the bench's cost.
        fleet = AgentFleet(f"ws://127.0.0.1:{args.port}/agent/ws", tokens, args.heartbeat)
        # A thousand agents in one process is the bench's artefact (each node runs its own): keep their
        # heap out of full collections, whose pauses would be counted as the control plane's delay.
        gc.collect()
        gc.freeze()
        started = time.perf_counter()
        fleet.start()
        # Recorded by its hello (which sets the agent's version), not merely alive (a heartbeat marks it READY).
        ready = Node.objects.filter(state=NodeState.READY).exclude(agent_version="")
        while ready.count() < n:
            if time.perf_counter() - started > 120:
                raise SystemExit(f"only {ready.count()} of {n} hellos recorded after 120 s")
            time.sleep(0.1)
        hellos = time.perf_counter() - started
        print(f"    all {n} hellos recorded in {hellos:.1f} s", flush=True)

        cpu0, wall0 = cpu_seconds(server.pid), time.perf_counter()
        time.sleep(args.steady)
        cpu = (cpu_seconds(server.pid) - cpu0) / (time.perf_counter() - wall0) * 100
        rss = rss_mb(server.pid)
        print(f"    steady heartbeats: CP CPU {cpu:.0f}%, RSS {rss:.0f} MB", flush=True)

        outbox = Outbox(epoch=1)
        for i, node in enumerate(nodes):
            outbox.stop(node.name, 10_000_000 + i)
        with transaction.atomic():
            outbox.send_on_commit()
            sent_at = time.perf_counter()  # the commit follows at once; delivery runs on commit
        first_wait = time.perf_counter() + 3.0
        while time.perf_counter() < first_wait and sum(1 for t in fleet.received.values() if t) < n:
            time.sleep(0.05)
        first = {name: times[0] for name, times in fleet.received.items() if times and times[0] - sent_at < 3.0}
        acked_in = "-"
        if PendingCommand is not None:
            tick_seconds = float(os.environ.get("LLMGW_TICK_SECONDS", "2"))
            deadline = time.perf_counter() + 30
            next_tick = sent_at + tick_seconds
            while PendingCommand.objects.exists() and time.perf_counter() < deadline:
                if time.perf_counter() >= next_tick:  # what the leader's tick does with them
                    with transaction.atomic():
                        resend_unacknowledged(timezone_now())
                    next_tick += tick_seconds
                time.sleep(0.05)
            left = PendingCommand.objects.count()
            acked_in = f"{time.perf_counter() - sent_at:.1f} s" if not left else f"{left} never"
        received_all = sum(1 for t in fleet.received.values() if t)
        delays = sorted((t - sent_at) * 1000 for t in first.values())
        p50 = statistics.median(delays) if delays else float("nan")
        p99 = delays[min(len(delays) - 1, int(len(delays) * 0.99))] if delays else float("nan")
        print("DECILES", [round(delays[int(len(delays) * q / 20)]) for q in range(20)], round(delays[-1]))
        print(
            f"    burst: {len(first)} of {n} received on the first send, p50 {p50:.0f} ms p99 {p99:.0f} ms", flush=True
        )

        client = redis.Redis.from_url(args.redis)
        groups = list(client.scan_iter(match="llmgw:asgi:group:node.*"))
        extra = sum(max(0, client.zcard(g) - 1) for g in groups)
        fleet.stop()
        fleet = None
        # Every stream's disconnect leaves its group; give the control plane a few seconds to process them.
        deadline = time.perf_counter() + 10
        while True:
            left = sum(client.zcard(g) for g in client.scan_iter(match="llmgw:asgi:group:node.*"))
            if not left or time.perf_counter() > deadline:
                break
            time.sleep(0.2)
        print(f"    group members: {extra} beyond one per node while connected, {left} left after disconnect")
        leaked = extra + left
        errors = f"{handshakes_500.count} / {full.count} / {leaked}"
        return (
            f"| {n} | {hellos:.1f} s | {cpu:.0f}% | {rss:.0f} MB | {p50:.0f} / {p99:.0f} ms "
            f"| {len(first)} / {received_all} of {n} | {acked_in} | {errors} |"
        )
    finally:
        if fleet is not None:
            fleet.stop()
        logging.getLogger("agent.link").removeHandler(handshakes_500)
        logging.getLogger("reconciler.outbox").removeHandler(full)
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def timezone_now():
    from django.utils import timezone

    return timezone.now()


def wait_for_port(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the control plane exited with code {server.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"the control plane did not listen on port {port} within 30 s")


if __name__ == "__main__":
    main()
