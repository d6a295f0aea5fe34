"""Fair shares of a full model: tenants' waits and served tokens when the model's capacity is the bottleneck.

    .venv/bin/python bench/fair_share_bench.py [--scenario all|flood|four|weights|batch] [--seconds 60]
                                               [--capacity 8] [--token-ms 25] [--routers 1] [--redis URL]

One model is served by one mock engine running `--capacity` requests at once (`--max-num-seqs`, the rest wait in
its own queue), `--token-ms` a token, published with that capacity (the profile's max concurrency); `--routers`
routers run as in a fleet (`manage.py router`, one SQLite database of teams and keys, the table in Redis); a client
sends each tenant's requests as Poisson arrivals, streamed, to a router drawn at random. A request's wait is its
time to first token as the client sees it (the engine's first token takes one token time). The model's capacity in
requests a second is `capacity / (answer tokens × token time)`.

* `flood`: tenant B alone at 0.2× capacity, then again beside tenant A at 10× (equal weights): B's p99 wait
  beside A against alone.
* `four`: four equal-weight tenants each at 1× capacity, answers of 10, 20, 40 and 80 tokens: Jain's index of the
  tokens served per tenant, per 20 s and over the run.
* `weights`: two tenants of weights 3 and 1, each at 2× capacity: the ratio of their served tokens.
* `batch`: interactive at 0.5× capacity alone, then beside batch at 20×: interactive's p99 wait against alone.

Served tokens are counted from the client's side (each answer's usage chunk), over the middle of the run (the first
and last 10% left out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hub.contracts import EndpointRow, EndpointTable, ModelEntry  # noqa: E402
from hub.redis_hub import RedisHub  # noqa: E402
from tests.e2e.engines.cutter import free_port  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from budget_bench import wait_ready  # noqa: E402  (a sibling script, not a package)

MODEL = "bench-model"
EMPTY = re.compile(rb'"content":\s*""')
SETUP = """
from keys.models import ApiKey
from teams.models import Team
for name, weight, priority in SPEC:
    team = Team.objects.create(name=name, weight=weight, priority_class=priority)
    print('made', name, ApiKey.issue(name, team=team)[1])
"""
TENANTS = [("a", 1, "standard"), ("b", 1, "standard"), ("c", 1, "standard"), ("d", 1, "standard")]
TENANTS += [("heavy", 3, "standard"), ("light", 1, "standard"), ("chat", 1, "interactive"), ("jobs", 1, "batch")]


class Fleet:
    """One mock engine of a fixed capacity and `routers` routers sharing Redis and a SQLite database of keys."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workdir = Path(tempfile.mkdtemp(prefix="llmgw-fair-bench-"))
        env = {**os.environ, "LLMGW_HOME": str(self.workdir), "SECRET_KEY": "bench-only", "LOG_LEVEL": "WARNING"}
        env.pop("DATABASE_URL", None)
        self.env = env | {"REDIS_URL": args.redis, "LLMGW_QUEUE_MAX_WAITING": "100000"}
        self.processes: list[subprocess.Popen] = []
        self.keys: dict[str, str] = {}
        self.routers: list[str] = []

    def start(self) -> None:
        redis.Redis.from_url(self.args.redis).flushdb()
        manage = [sys.executable, "manage.py"]
        subprocess.run([*manage, "migrate", "-v0"], cwd=ROOT, env=self.env, check=True)
        code = f"SPEC = {TENANTS!r}\n{SETUP}"
        out = subprocess.run(
            [*manage, "shell", "-c", code], cwd=ROOT, env=self.env, check=True, capture_output=True, text=True
        )
        for line in out.stdout.splitlines():
            if line.startswith("made "):
                _, name, key = line.split()
                self.keys[name] = key
        port = free_port()
        argv = [sys.executable, "-m", "mockengine", "--port", str(port), "--model", MODEL, "--greedy"]
        argv += ["--token-delay-ms", str(self.args.token_ms), "--max-num-seqs", str(self.args.capacity)]
        self.processes.append(subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.engine = f"http://127.0.0.1:{port}"
        wait_ready(f"{self.engine}/health")
        row = EndpointRow(replica_id="1", model=MODEL, url=self.engine, capacity=self.args.capacity)
        RedisHub(self.args.redis).publish_endpoints(EndpointTable(models={MODEL: ModelEntry()}, endpoints=[row]))
        for _ in range(self.args.routers):
            port = free_port()
            with open(self.workdir / f"router-{port}.log", "wb") as log:
                self.processes.append(
                    subprocess.Popen([*manage, "router", "--port", str(port)], cwd=ROOT, env=self.env, stderr=log)
                )
            self.routers.append(f"http://127.0.0.1:{port}")
        for url in self.routers:
            wait_ready(f"{url}/readyz")

    def stop(self) -> None:
        for process in self.processes:
            process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


class Outcome:
    """One request as the client saw it."""

    __slots__ = ("tenant", "sent", "first", "status", "tokens", "queued")

    def __init__(self, tenant: str, sent: float) -> None:
        self.tenant, self.sent, self.first, self.status, self.tokens = tenant, sent, None, None, 0
        self.queued = 0.0  # what the router says it waited in its queue


async def one(session, fleet: Fleet, tenant: str, tokens: int, rng: random.Random, outcome: Outcome) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{tenant} {rng.random()}"}],
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {fleet.keys[tenant]}"}
    try:
        async with session.post(f"{rng.choice(fleet.routers)}/v1/chat/completions", json=body, headers=headers) as r:
            outcome.status = r.status
            outcome.queued = float(r.headers.get("x-llmgw-queue-seconds", 0))
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                if outcome.first is None and b'"content"' in line and not EMPTY.search(line):
                    outcome.first = time.perf_counter()  # the first chunk of text (not the role's, empty)
                if b'"usage"' in line and (usage := json.loads(line[6:]).get("usage")):
                    outcome.tokens = usage["completion_tokens"]
    except aiohttp.ClientError as exc:
        outcome.status = type(exc).__name__


async def load(fleet: Fleet, plan: list[tuple[str, float, int]], seconds: float, seed: int) -> list[Outcome]:
    """Each (tenant, requests a second, answer tokens) of `plan` as Poisson arrivals for `seconds`."""
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def arrivals(tenant: str, rate: float, tokens: int) -> None:
            end = time.perf_counter() + seconds
            while (now := time.perf_counter()) < end:
                outcome = Outcome(tenant, now)
                outcomes.append(outcome)
                tasks.append(asyncio.create_task(one(session, fleet, tenant, tokens, rng, outcome)))
                await asyncio.sleep(rng.expovariate(rate))

        await asyncio.gather(*(arrivals(*each) for each in plan))
        # What is still waiting when the load ends is not measured: the flood's queue would take minutes.
        await asyncio.sleep(min(30.0, seconds / 2))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return outcomes


def waits(outcomes: list[Outcome], tenant: str, skip: float = 0.0) -> list[float]:
    """`tenant`'s waits, sorted, of the requests sent after the first `skip` seconds of the load."""
    start = min(o.sent for o in outcomes) + skip
    return sorted(o.first - o.sent for o in outcomes if o.tenant == tenant and o.first is not None and o.sent >= start)


def pct(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, max(0, math.ceil(p / 100 * len(values)) - 1))] if values else float("nan")


def served(outcomes: list[Outcome], tenants: list[str], start: float, end: float) -> dict[str, int]:
    """Tokens served per tenant to requests whose first token came within [start, end)."""
    found = dict.fromkeys(tenants, 0)
    for o in outcomes:
        if o.tenant in found and o.first is not None and start <= o.first < end:
            found[o.tenant] += o.tokens
    return found


def jain(values) -> float:
    values = list(values)
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else float("nan")


def describe(label: str, values: list[float]) -> str:
    return (
        f"{label} {len(values)} served, wait p50 {pct(values, 50) * 1000:.0f} ms, p99 {pct(values, 99) * 1000:.0f} ms"
    )


def compare(name: str, label: str, alone: list[Outcome], beside: list[Outcome], tenant: str, seconds: float) -> None:
    """`tenant`'s waits alone and beside the other load, over the whole run and past its first 10%."""
    for part, skip in (("whole run", 0.0), ("past the first 10%", seconds / 10)):
        by_itself, with_other = waits(alone, tenant, skip), waits(beside, tenant, skip)
        print(f"{name} ({part}): {describe(f'{label} alone', by_itself)}; {describe('beside', with_other)}")
        if not skip:
            sent = sum(o.tenant == tenant for o in alone), sum(o.tenant == tenant for o in beside)
            print(f"{name}: {label} sent {sent[0]} alone, {sent[1]} beside")
        late = sum(w > 1.2 * pct(by_itself, 99) for w in with_other)
        start = min(o.sent for o in beside) + skip
        queued = sorted(o.queued for o in beside if o.tenant == tenant and o.first is not None and o.sent >= start)
        print(
            f"{name} ({part}): p99 beside / alone = {pct(with_other, 99) / pct(by_itself, 99):.2f}, "
            f"p99 beside - alone = {(pct(with_other, 99) - pct(by_itself, 99)) * 1000:.0f} ms; "
            f"{late} of {len(with_other)} waited past 1.2x alone's p99; in the router's queue: "
            f"{sum(q > 0 for q in queued)} waited, p99 {pct(queued, 99) * 1000:.0f} ms, max {queued[-1] * 1000:.0f} ms"
        )


async def scenario_flood(fleet: Fleet, args, rate: float) -> None:
    tokens = args.tokens
    capacity = rate / tokens
    alone = await load(fleet, [("b", 0.2 * capacity, tokens)], args.seconds, 1)
    beside = await load(fleet, [("a", 10 * capacity, tokens), ("b", 0.2 * capacity, tokens)], args.seconds, 2)
    compare("flood", "B", alone, beside, "b", args.seconds)
    print(f"flood: {describe('A', waits(beside, 'a'))} of {sum(o.tenant == 'a' for o in beside)} sent")


async def scenario_four(fleet: Fleet, args, rate: float) -> None:
    lengths = {"a": 10, "b": 20, "c": 40, "d": 80}
    plan = [(t, rate / n, n) for t, n in lengths.items()]  # each at 1x the capacity of its own answers
    outcomes = await load(fleet, plan, args.seconds, 3)
    start = min(o.sent for o in outcomes)
    cut = args.seconds / 10
    windows = []
    t = start + cut
    while t + 20 <= start + args.seconds - cut + 1e-9:
        windows.append(served(outcomes, list(lengths), t, t + 20))
        t += 20
    whole = served(outcomes, list(lengths), start + cut, start + args.seconds - cut)
    print(f"four: tokens served over the run {whole}, Jain {jain(whole.values()):.3f} (target >= 0.95)")
    print("four: Jain per 20 s " + ", ".join(f"{jain(w.values()):.3f}" for w in windows))


async def scenario_weights(fleet: Fleet, args, rate: float) -> None:
    tokens = args.tokens
    capacity = rate / tokens
    outcomes = await load(fleet, [("heavy", 2 * capacity, tokens), ("light", 2 * capacity, tokens)], args.seconds, 4)
    start = min(o.sent for o in outcomes)
    cut = args.seconds / 10
    tally = served(outcomes, ["heavy", "light"], start + cut, start + args.seconds - cut)
    print(f"weights 3:1: tokens served {tally}, ratio {tally['heavy'] / max(1, tally['light']):.2f} (target 3 +- 5%)")


async def scenario_batch(fleet: Fleet, args, rate: float) -> None:
    tokens = args.tokens
    capacity = rate / tokens
    alone = await load(fleet, [("chat", 0.5 * capacity, tokens)], args.seconds, 5)
    beside = await load(fleet, [("chat", 0.5 * capacity, tokens), ("jobs", 20 * capacity, tokens)], args.seconds, 6)
    compare("batch", "interactive", alone, beside, "chat", args.seconds)
    print(f"batch: {describe('batch', waits(beside, 'jobs'))} of {sum(o.tenant == 'jobs' for o in beside)} sent")
    print(f"batch: one engine step is {args.token_ms:g} ms")


SCENARIOS = {"flood": scenario_flood, "four": scenario_four, "weights": scenario_weights, "batch": scenario_batch}


async def main_async(args: argparse.Namespace) -> None:
    fleet = Fleet(args)
    fleet.start()
    # Tokens the engine serves a second at capacity.
    rate = args.capacity / (args.token_ms / 1000)
    print(
        f"capacity {args.capacity} requests at once, {args.token_ms:g} ms a token: {rate:.0f} tokens/s; "
        f"{args.routers} router(s); {args.seconds:g} s per load"
    )
    try:
        for name, run in SCENARIOS.items():
            if args.scenario in ("all", name):
                await run(fleet, args, rate)
    finally:
        fleet.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=["all", *SCENARIOS], default="all")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--capacity", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=40, help="answer tokens (flood, weights, batch)")
    parser.add_argument("--token-ms", type=float, default=25.0)
    parser.add_argument("--routers", type=int, default=1)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/12")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
