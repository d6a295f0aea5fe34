"""Streams under fire: many concurrent streams through one router while its engines are killed and one is drained,
each answer checked token for token.

    .venv/bin/python bench/continuation_bench.py [--streams 1000] [--tokens 200-2000] [--replicas 3]
                                                 [--kill-every 3] [--way token_ids|text] [--seed 1] [--migrations 2]
                                                 [--drain-after 10] [--drain-timeout 5] [--redis URL]

The router runs as in a fleet (`manage.py router`, its endpoint table read from Redis: `--redis`, a database the
bench empties), and this script plays the control plane and the agents. It publishes one model served by
`--replicas` mock engines in greedy mode (mockengine/greedy.py: each token a function of everything before it, as
greedy decoding of a language model). `--streams` chat streams start at once, each asking for a length drawn from
`--tokens`. Every `--kill-every` seconds one engine is SIGKILLed mid-answer (its streams break; connections to it
are refused) and started again on its port a second later. `--drain-after` seconds in, one engine is drained as
the control plane drains a node, make-before-break: a replacement engine is started and published, the old one
unpublished and named in the table's `moving` (router.forwarding.moves) for `--drain-timeout` seconds less two
from now; half a second later (the unpublish grace) the agent's drain polls the engine's running requests until
none are left or the timeout passes, then stops it. Each stream's text is compared with what greedy decoding gives
for its request, computed here from the same functions: a stream counts as complete only if it ended with
`[DONE]`, no error event, and exactly that text (no token lost, none repeated). The router's own figures give the
continuations by reason and outcome and the pause each added (`llmgw_router_stream_continuation_gap_seconds`):
the gap runs from the break to the next leg's first token, which an engine makes one token interval
(`--token-delay-ms`) after taking the request; the added gap is the gap less that interval, the pause the client
would not have had without the break.
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
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hub.contracts import EndpointRow, EndpointTable, ModelEntry  # noqa: E402
from hub.redis_hub import RedisHub  # noqa: E402
from mockengine.greedy import chat_context, next_words, token_texts  # noqa: E402
from tests.e2e.engines.cutter import free_port, router_process  # noqa: E402

# How long before its drain would time out the control plane has routers move a leaving replica's streams.
MOVE_LEAD_SECONDS = 2.0
UNPUBLISH_GRACE_SECONDS = 0.5

MODEL = "bench-model"


class Engine:
    """A mock engine in greedy mode on a port of its own, to be killed and started again there."""

    def __init__(self, delay_ms: float) -> None:
        self.port, self.delay_ms = free_port(), delay_ms
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "mockengine", "--port", str(self.port), "--model", MODEL, "--greedy"]
        argv += ["--token-delay-ms", str(self.delay_ms)]
        self.process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=0.5).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError(f"mock engine on {self.port} did not start")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(5)


def expected_text(body: dict) -> str:
    context, continued = chat_context(body["messages"], body)
    return "".join(token_texts(next_words(context, body["max_tokens"]), bare_first=not continued))


async def one_stream(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[bool, str]:
    """(whether it ended with [DONE] and no error event, its text). The bytes are read as they come and decoded
    once the stream has ended: a client on a machine of its own takes none of the router's cores, and this one
    shares them."""
    received = []
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                return False, ""
            async for chunk in response.content.iter_any():
                received.append(chunk)
    except aiohttp.ClientError:
        return False, read_stream(b"".join(received))[1]
    return read_stream(b"".join(received))


def read_stream(raw: bytes) -> tuple[bool, str]:
    """(whether the stream ended with [DONE] and had no error event, its text)."""
    parts, done, error = [], False, False
    for line in raw.splitlines():
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            done = True
            continue
        event = json.loads(data)
        error |= "error" in event
        for choice in event.get("choices", ()):
            parts.append(choice["delta"].get("content") or "")
    return done and not error, "".join(parts)


class Fleet:
    """The engines serving the model, as the control plane publishes them (replica id -> engine)."""

    def __init__(self, hub: RedisHub, token_ids: bool) -> None:
        self.hub, self.token_ids = hub, token_ids
        self.serving: dict[str, Engine] = {}
        self.started: list[Engine] = []  # every engine, drained ones included: all are stopped at the end
        self._ids = 0

    def add(self, engine: Engine) -> str:
        self.started.append(engine)
        self._ids += 1
        self.serving[str(self._ids)] = engine
        return str(self._ids)

    def publish(self, moving: dict[str, float] | None = None) -> None:
        rows = [
            EndpointRow(replica_id=pk, model=MODEL, url=f"http://127.0.0.1:{engine.port}")
            for pk, engine in self.serving.items()
        ]
        models = {MODEL: ModelEntry(token_ids=self.token_ids)}
        self.hub.publish_endpoints(EndpointTable(models=models, endpoints=rows, moving=moving or {}))


async def killer(fleet: Fleet, every: float, stop: asyncio.Event, rng: random.Random, kills: list) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), every)
            return
        except TimeoutError:
            pass
        engine = rng.choice(list(fleet.serving.values()))
        engine.kill()
        kills.append(time.monotonic())
        await asyncio.sleep(1.0)
        await asyncio.to_thread(engine.start)


def running(engine: Engine) -> float | None:
    """The requests the engine says it runs (vllm:num_requests_running); None if it cannot be read."""
    try:
        text = httpx.get(f"http://127.0.0.1:{engine.port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    families = text_string_to_metric_families(text)
    return sum(s.value for f in families if f.name == "vllm:num_requests_running" for s in f.samples)


async def drainer(fleet: Fleet, after: float, timeout: float, delay_ms: float, drains: list) -> None:
    """Drain one engine `after` seconds in, as the control plane and its agent do (see the module)."""
    await asyncio.sleep(after)
    # The engine running the most streams: one just killed and started again may hold none.
    held = {pk: await asyncio.to_thread(running, engine) or 0 for pk, engine in fleet.serving.items()}
    pk = max(held, key=held.__getitem__)
    old, fresh = fleet.serving[pk], Engine(delay_ms)
    await asyncio.to_thread(fresh.start)  # make-before-break: the replacement first
    del fleet.serving[pk]
    fleet.add(fresh)
    unpublished = time.time()
    fleet.publish(moving={pk: unpublished + max(0.0, timeout - MOVE_LEAD_SECONDS)})
    await asyncio.sleep(UNPUBLISH_GRACE_SECONDS)
    began, left = time.monotonic(), None
    while time.monotonic() - began < timeout:
        left = await asyncio.to_thread(running, old)
        if left == 0:
            break
        await asyncio.sleep(0.5)
    waited = time.monotonic() - began
    why = "drained" if left == 0 else f"timed out with {left if left is not None else 'unknown'} running"
    old.kill()
    drains.append(f"{why} after {waited:.1f} s")


async def run(args, url: str, key: str, fleet: Fleet) -> dict:
    rng = random.Random(args.seed)
    low, high = (int(n) for n in args.tokens.split("-"))
    bodies = []
    for i in range(args.streams):
        messages = [{"role": "user", "content": f"stream {i} of the continuation bench"}]
        bodies.append({"model": MODEL, "messages": messages, "stream": True, "max_tokens": rng.randint(low, high)})
    stop, kills, drains = asyncio.Event(), [], []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        shooting = asyncio.ensure_future(killer(fleet, args.kill_every, stop, rng, kills))
        draining = None
        if args.drain_after >= 0:
            draining = asyncio.ensure_future(
                drainer(fleet, args.drain_after, args.drain_timeout, args.token_delay_ms, drains)
            )
        began = time.monotonic()
        results = await asyncio.gather(*(one_stream(session, url, body) for body in bodies))
        took = time.monotonic() - began
        stop.set()
        await shooting
        if draining is not None:
            draining.cancel()
    ok = [ended and text == expected_text(body) for (ended, text), body in zip(results, bodies, strict=True)]
    wrong = sum(ended and text != expected_text(body) for (ended, text), body in zip(results, bodies, strict=True))
    tokens = sum(body["max_tokens"] for body in bodies)
    drain = drains[0] if drains else "-"
    return {"complete": sum(ok), "wrong": wrong, "seconds": took, "kills": len(kills), "tokens": tokens, "drain": drain}


def fleet_router(workdir: Path, redis_url: str) -> tuple[subprocess.Popen, str, str]:
    """A router as a fleet runs it (`manage.py router`, the table from Redis, keys in a SQLite file of its own in
    `workdir`); (process, URL, a client key)."""
    return router_process(workdir, "streams", [], {"REDIS_URL": redis_url})


def router_figures(url: str) -> tuple[dict, list]:
    """(continuations by (reason, outcome), the gap histogram's cumulative buckets)."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
    outcomes, buckets = {}, []
    for family in families:
        for sample in family.samples:
            if sample.name == "llmgw_router_stream_continuations_total":
                outcomes[sample.labels["reason"], sample.labels["outcome"]] = int(sample.value)
            elif sample.name == "llmgw_router_stream_continuation_gap_seconds_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
    return outcomes, sorted(buckets)


def quantile(buckets: list, q: float, less_ms: float = 0.0) -> str:
    """The bucket bound within which a `q` share of the gaps fall (less `less_ms`)."""
    total = buckets[-1][1] if buckets else 0
    for bound, count in buckets:
        if total and count >= q * total:
            return f"≤ {bound * 1000 - less_ms:g} ms"
    return "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--tokens", default="200-2000", help="each stream's length, drawn from LOW-HIGH")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--kill-every", type=float, default=3.0, help="seconds between two engines killed")
    parser.add_argument("--token-delay-ms", type=float, default=2.0)
    parser.add_argument("--way", choices=("token_ids", "text"), default="token_ids")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--migrations", type=int, default=2, help="LLMGW_STREAM_MIGRATIONS of the router")
    parser.add_argument("--drain-after", type=float, default=10.0, help="seconds in (negative: no drain)")
    parser.add_argument("--drain-timeout", type=float, default=5.0, help="LLMGW_DRAIN_TIMEOUT_SECONDS of the drain")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/7", help="a Redis database the bench empties")
    args = parser.parse_args()
    os.environ["LLMGW_STREAM_MIGRATIONS"] = str(args.migrations)
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-continuation-"))
    hub = RedisHub(args.redis)
    hub._sync.flushdb()
    fleet = Fleet(hub, token_ids=args.way == "token_ids")
    for _ in range(args.replicas):
        engine = Engine(args.token_delay_ms)
        engine.start()
        fleet.add(engine)
    fleet.publish()
    router, url, key = fleet_router(workdir, args.redis)
    try:
        found = asyncio.run(run(args, url, key, fleet))
        outcomes, buckets = router_figures(url)
    finally:
        router.terminate()
        router.wait(10)
        for engine in fleet.started:
            engine.kill()
    n = args.streams
    print(
        "| streams | complete | wrong text | engines killed | drain | tokens | seconds | continuations | gap p50 | gap p99 "
        "| added gap p50 | added gap p99 |"
    )
    print("|---:|---:|---:|---:|---|---:|---:|---|---|---|---|---|")
    continued = ", ".join(f"{reason}/{outcome}: {count}" for (reason, outcome), count in sorted(outcomes.items()))
    print(
        f"| {n} | {found['complete']} ({100 * found['complete'] / n:.2f}%) | {found['wrong']} | {found['kills']} "
        f"| {found['drain']} | {found['tokens']:,} | {found['seconds']:.1f} | {continued or '-'} "
        f"| {quantile(buckets, 0.5)} | {quantile(buckets, 0.99)} "
        f"| {quantile(buckets, 0.5, args.token_delay_ms)} | {quantile(buckets, 0.99, args.token_delay_ms)} |"
    )
    return 0 if found["complete"] >= 0.999 * n and not found["wrong"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
