"""A budget under a burst: many concurrent streams on one key through two routers sharing Redis, the budget
covering only part of them; the budget is never exceeded, and the counters equal the ledger and what the client
can work out it was charged.

    .venv/bin/python bench/budget_bench.py [--streams 500] [--covers 300] [--cut 0.2] [--tokens 20-400]
                                           [--kill-router-after 0] [--reservation-seconds 8] [--redis URL]

Two routers run as in a fleet (`manage.py router`, one SQLite database of keys, the endpoint table and the
budgets' counters in Redis: `--redis`, a database the bench empties); this script plays the control plane. One
model is served by two mock engines at 20 ms a token, priced 1 per million prompt tokens and 4 per million
completion tokens. One key of a team whose budget (no window) covers about `--covers` of the streams' worst cases
(prompt bytes + max_tokens); `--streams` streams start at once, half on each router, each asking for a number of
tokens drawn from `--tokens` (stream_options.include_usage: the client reads its own usage), and a share `--cut`
of them hung up after their first chunk. While they run, the budget's counter is read every 5 ms: its highest value
is the most ever held. Once everything has settled: the counter, the ledger (the hub's spend of the key) and the
client's own sum (usage × prices for answers it read whole, the reservation for those it hung up on) are compared.

With `--kill-router-after S` the second router is SIGKILLed S seconds in, and the routers reserve for
`--reservation-seconds`: its reservations then expire charged at what they reserved (the sweep runs when the
control plane takes the ledger, here called by the bench), and the client's sum counts a reservation for every
stream the dead router held.

With `--requests N` it runs instead N answers one after another (whole JSON, 1–400 tokens asked) over three teams
of two keys, alternating between the routers: each team has a budget, one key's holder a member's budget, the other
key its own, all running out partway. Before each request the client works out from its own sums of settled costs
whether the request's worst case fits every budget that applies: a refusal when it fits is a false 429, an answer
when it does not would be an overrun. At the end the ledger's spend per team is compared with the client's sums,
and each budget's counter with the client's sum for it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hub.contracts import EndpointRow, EndpointTable, ModelEntry  # noqa: E402
from hub.credentials import hash_secret  # noqa: E402
from hub.redis_budgets import TOKENS_KEY, RedisBudgets  # noqa: E402
from hub.redis_hub import RedisHub  # noqa: E402
from tests.e2e.engines.cutter import free_port  # noqa: E402

MODEL = "bench-model"
PRICE_IN, PRICE_OUT = 1_000_000, 4_000_000  # 1 and 4 per million tokens, in spend units per token


def start_engine(port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "mockengine", "--port", str(port), "--model", MODEL, "--greedy"]
    argv += ["--token-delay-ms", "20"]
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(f"http://127.0.0.1:{port}/health")
    return process


def wait_ready(url: str) -> None:
    for _ in range(300):
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not get ready")


def setup_database(env: dict[str, str], amount: str) -> tuple[str, int]:
    """Migrate, then a team with a budget of `amount` (no window) and a key of it: (the key, the budget's id)."""
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    code = (
        "from decimal import Decimal\n"
        "from django.contrib.auth.models import User\n"
        "from keys.models import ApiKey, Budget\n"
        "from teams.models import Membership, Team\n"
        "team = Team.objects.create(name='bench')\n"
        "user = User.objects.create_user('bench')\n"
        "Membership.objects.create(team=team, user=user)\n"
        f"budget = Budget.objects.create(team=team, amount=Decimal('{amount}'), window='none')\n"
        "print('made', ApiKey.issue('bench', team=team, user=user)[1], budget.pk)\n"
    )
    out = subprocess.run([*manage, "shell", "-c", code], cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    _, key, budget = next(line for line in out.stdout.splitlines() if line.startswith("made ")).split()
    return key, int(budget)


async def one_stream(session: aiohttp.ClientSession, url: str, key: str, body: bytes, cut: bool) -> tuple[str, object]:
    """('refused', None) | ('cut', None) | ('whole', (prompt, completion)) | ('broken', None)."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    try:
        async with session.post(f"{url}/v1/chat/completions", data=body, headers=headers) as response:
            if response.status == 429:
                return "refused", (await response.json())["error"]["code"]
            if response.status != 200:
                return "broken", response.status
            if cut:
                await response.content.readany()
                response.close()
                return "cut", None
            raw = await response.read()
    except aiohttp.ClientError as exc:
        return "broken", type(exc).__name__
    usage = None
    for line in raw.splitlines():
        if line.startswith(b"data: {") and b'"usage"' in line:
            found = json.loads(line[6:]).get("usage")
            if found:
                usage = (found["prompt_tokens"], found["completion_tokens"])
    return ("whole", usage) if usage else ("broken", None)


async def run(args: argparse.Namespace) -> None:
    hub = RedisHub(args.redis)
    client = redis.Redis.from_url(args.redis)
    client.flushdb()
    rng = random.Random(args.seed)
    low, high = (int(x) for x in args.tokens.split("-"))
    bodies = []
    for i in range(args.streams):
        asked = rng.randint(low, high)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"tell me a story number {i}"}],
            "max_tokens": asked,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        bodies.append((json.dumps(body).encode(), rng.random() < args.cut))
    worst = [len(body) * PRICE_IN + json.loads(body)["max_tokens"] * PRICE_OUT for body, _ in bodies]
    limit = sum(worst) * args.covers // args.streams
    amount = f"{limit / 10**12:.6f}"
    limit = int(round(float(amount) * 10**6)) * 10**6  # as the budget stores it: six decimals

    engines = [free_port(), free_port()]
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-budget-bench-"))
    env = {**os.environ, "LLMGW_HOME": str(workdir), "SECRET_KEY": "bench-only", "LOG_LEVEL": "WARNING"}
    env.pop("DATABASE_URL", None)
    env |= {"REDIS_URL": args.redis, "LLMGW_BUDGET_RESERVATION_SECONDS": str(args.reservation_seconds)}
    key, budget_id = setup_database(env, amount)
    processes = [start_engine(port) for port in engines]
    rows = [EndpointRow(replica_id=str(i + 1), model=MODEL, url=f"http://127.0.0.1:{p}") for i, p in enumerate(engines)]
    entry = ModelEntry(price_input=PRICE_IN, price_output=PRICE_OUT, output_bound=4096)
    hub.publish_endpoints(EndpointTable(models={MODEL: entry}, endpoints=rows))
    routers = []
    for _ in range(2):
        port = free_port()
        argv = [sys.executable, "manage.py", "router", "--port", str(port)]
        with open(workdir / f"router-{port}.log", "wb") as log:  # the router writes on after this closes it
            routers.append((subprocess.Popen(argv, cwd=ROOT, env=env, stderr=log), f"http://127.0.0.1:{port}"))
    for _, url in routers:
        wait_ready(f"{url}/readyz")
    counters = RedisBudgets(client)
    counter = f"{budget_id}:all"
    peak = 0
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
            started = time.perf_counter()
            tasks = [
                asyncio.create_task(one_stream(session, routers[i % 2][1], key, body, cut))
                for i, (body, cut) in enumerate(bodies)
            ]
            killed = False
            while not all(task.done() for task in tasks):
                peak = max(peak, counters.used(counter))
                if args.kill_router_after and not killed and time.perf_counter() - started > args.kill_router_after:
                    routers[1][0].send_signal(signal.SIGKILL)
                    killed = True
                await asyncio.sleep(0.005)
            outcomes = [task.result() for task in tasks]
            elapsed = time.perf_counter() - started
        time.sleep(1.0)  # the settlements' tasks
        if args.kill_router_after:
            time.sleep(args.reservation_seconds)
        swept = counters.sweep()
        used = counters.used(counter)
        fields = {k.decode(): int(v) for k, v in client.hgetall(TOKENS_KEY).items()}
        ledger = sum(v for k, v in fields.items() if k.startswith("spend "))
    finally:
        for process, _ in routers:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            process.kill()
        for process, _ in routers:
            process.wait(30)
    report(args, bodies, outcomes, worst, limit, peak, used, ledger, swept, elapsed)


def report(args, bodies, outcomes, worst, limit, peak, used, ledger, swept, elapsed) -> None:
    kinds: dict[str, int] = {}
    client_sum = 0
    for (kind, usage), cost in zip(outcomes, worst, strict=True):
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind == "broken":
            kinds[f"broken {usage}"] = kinds.get(f"broken {usage}", 0) + 1
        if kind == "whole":
            client_sum += usage[0] * PRICE_IN + usage[1] * PRICE_OUT
        elif kind in ("cut", "broken"):
            client_sum += cost  # hung up (or its router died): charged what it reserved
    admitted = len(outcomes) - kinds.get("refused", 0)
    print(f"streams {len(bodies)} in {elapsed:.1f} s: {kinds}; admitted {admitted}")
    print(f"budget {limit / 10**12:.6f}: peak held {peak / 10**12:.6f}, beyond it {max(0, peak - limit)} units")
    print(
        f"after settling: counter {used}, ledger {ledger}, client's sum {client_sum}; expired reservations swept {swept}"
    )
    print(
        f"counter == ledger: {used == ledger}; ledger == client's sum: {ledger == client_sum}; within budget: {used <= limit}"
    )


TEAMS_SETUP = """
from decimal import Decimal
from django.contrib.auth.models import User
from keys.models import ApiKey, Budget
from teams.models import Membership, Team
for t, team_amount, member_amount, key_amount in SPEC:
    team = Team.objects.create(name=f'team-{t}')
    whole = Budget.objects.create(team=team, amount=Decimal(team_amount), window='none')
    for m in range(2):
        user = User.objects.create_user(f'user-{t}-{m}')
        Membership.objects.create(team=team, user=user)
        key, plain = ApiKey.issue(f'key-{t}-{m}', team=team, user=user)
        if m == 0:  # a member's budget for this one's holder, the key's own for the other
            own = Budget.objects.create(team=team, user=user, amount=Decimal(member_amount), window='none')
        else:
            own = Budget.objects.create(key=key, amount=Decimal(key_amount), window='none')
        print('made', t, plain, f'{whole.pk}={int(whole.amount.scaleb(12))}', f'{own.pk}={int(own.amount.scaleb(12))}')
"""


def teams_run(args: argparse.Namespace) -> None:
    """`--requests` answers one after another over three teams of two keys each (a team budget for both, a
    member's budget for one key's holder, a key's own for the other), alternating between the two routers: each
    answer is checked against the client's own count of every budget's settled spend."""
    client = redis.Redis.from_url(args.redis)
    client.flushdb()
    hub = RedisHub(args.redis)
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-budget-bench-"))
    env = {**os.environ, "LLMGW_HOME": str(workdir), "SECRET_KEY": "bench-only", "LOG_LEVEL": "WARNING"}
    env.pop("DATABASE_URL", None)
    env["REDIS_URL"] = args.redis
    # Budgets that run out partway: a key's share of the requests costs about `share` (an answer of the mock
    # engine here: about 12 prompt tokens and 2 completion tokens, 20 units of 10^-6).
    share = 20 * 10**6 * args.requests // 6
    spec = [(t, *(f"{share * n // d / 10**12:.6f}" for n, d in ((3, 2), (1, 2), (2, 3)))) for t in range(3)]
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    out = subprocess.run(
        [*manage, "shell", "-c", f"SPEC = {spec!r}\n" + TEAMS_SETUP],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    keys = []  # (team, key, {budget id: limit})
    for line in out.splitlines():
        if line.startswith("made "):
            _, t, plain, *budgets = line.split()
            keys.append((int(t), plain, {int(b): int(limit) for b, limit in (x.split("=") for x in budgets)}))
    engine = free_port()
    process = start_engine_fast(engine)
    rows = [EndpointRow(replica_id="1", model=MODEL, url=f"http://127.0.0.1:{engine}")]
    hub.publish_endpoints(
        EndpointTable(models={MODEL: ModelEntry(price_input=PRICE_IN, price_output=PRICE_OUT)}, endpoints=rows)
    )
    routers = []
    for _ in range(2):
        port = free_port()
        routers.append(
            (
                subprocess.Popen(
                    [*manage, "router", "--port", str(port)], cwd=ROOT, env=env, stderr=subprocess.DEVNULL
                ),
                f"http://127.0.0.1:{port}",
            )
        )
    for _, url in routers:
        wait_ready(f"{url}/readyz")
    limits: dict[int, int] = {}
    used: dict[int, int] = {b: 0 for _, _, applies in keys for b in applies}
    spent = [0, 0, 0]
    false_refusals = admitted_beyond = refused = 0
    started = time.perf_counter()
    try:
        with httpx.Client(timeout=30) as http:
            for i in range(args.requests):
                team, plain, applies = keys[rng.randrange(len(keys))]
                limits.update(applies)
                asked = rng.randint(1, 400)
                body = json.dumps(
                    {"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": asked}
                ).encode()
                worst = len(body) * PRICE_IN + asked * PRICE_OUT
                fits = all(used[b] + worst <= limits[b] for b in applies)
                reply = http.post(
                    f"{routers[i % 2][1]}/v1/chat/completions",
                    content=body,
                    headers={"Authorization": f"Bearer {plain}", "Content-Type": "application/json"},
                )
                if reply.status_code == 429:
                    refused += 1
                    false_refusals += fits
                    continue
                reply.raise_for_status()
                admitted_beyond += not fits
                usage = reply.json()["usage"]
                cost = usage["prompt_tokens"] * PRICE_IN + usage["completion_tokens"] * PRICE_OUT
                for b in applies:
                    used[b] += cost
                spent[team] += cost
        elapsed = time.perf_counter() - started
        time.sleep(1.0)
        fields = {k.decode(): int(v) for k, v in client.hgetall(TOKENS_KEY).items()}
    finally:
        for router, _ in routers:
            router.send_signal(signal.SIGTERM)
        process.kill()
        for router, _ in routers:
            router.wait(30)
    ledger = [0, 0, 0]
    digests = {hash_secret(plain): team for team, plain, _ in keys}
    for field, value in fields.items():
        kind, _hour, digest, _model = field.split(" ", 3)
        if kind == "spend":
            ledger[digests[digest]] += value
    counters = RedisBudgets(client)
    print(
        f"{args.requests} requests in {elapsed:.1f} s over two routers: {refused} refused, false refusals {false_refusals}, admitted beyond a budget {admitted_beyond}"
    )
    print(f"per team spend, ledger: {ledger}; client's sum: {spent}; equal: {ledger == spent}")
    drift = {b: counters.used(f"{b}:all") - used[b] for b in used}
    print(f"counters less the client's sums, per budget: {drift}")


def start_engine_fast(port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "mockengine", "--port", str(port), "--model", MODEL]
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(f"http://127.0.0.1:{port}/health")
    return process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--covers", type=int, default=300, help="how many streams' worst cases the budget covers")
    parser.add_argument("--cut", type=float, default=0.2, help="share of streams the client hangs up on")
    parser.add_argument("--tokens", default="20-400", help="range of max_tokens asked")
    parser.add_argument("--kill-router-after", type=float, default=0.0, help="SIGKILL the second router then (s)")
    parser.add_argument("--reservation-seconds", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/11")
    parser.add_argument("--requests", type=int, default=0, help="instead: this many answers over three teams")
    args = parser.parse_args()
    if args.requests:
        teams_run(args)
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
