"""Streams under fire: many concurrent streams through one router while its engines are killed, each answer
checked token for token.

    .venv/bin/python bench/continuation_bench.py [--streams 1000] [--tokens 200-2000] [--replicas 3]
                                                 [--kill-every 3] [--way token_ids|text] [--seed 1] [--migrations 2]

Router-only mode (`manage.py router --endpoints FILE`) serves one model from `--replicas` mock engines in greedy
mode (mockengine/greedy.py: each token a function of everything before it, as greedy decoding of a language
model). `--streams` chat streams start at once, each asking for a length drawn from `--tokens`. Every
`--kill-every` seconds one engine is SIGKILLed mid-answer (its streams break; connections to it are refused)
and started again on its port a second later. Each stream's text is compared with what greedy decoding gives
for its request, computed here from the same functions: a stream counts as complete only if it ended with
`[DONE]`, no error event, and exactly that text (no token lost, none repeated). The router's own figures give
the continuations by outcome and the pause each added (`llmgw_router_stream_continuation_gap_seconds`).
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

from mockengine.greedy import chat_context, next_words, token_texts  # noqa: E402
from tests.e2e.engines.cutter import free_port, router_only  # noqa: E402

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
    """(whether it ended with [DONE] and no error event, its text)."""
    parts, done, error = [], False, False
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                return False, ""
            async for line in response.content:
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
    except aiohttp.ClientError:
        return False, "".join(parts)
    return done and not error, "".join(parts)


async def killer(engines: list[Engine], every: float, stop: asyncio.Event, rng: random.Random, kills: list) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), every)
            return
        except TimeoutError:
            pass
        engine = rng.choice(engines)
        engine.kill()
        kills.append(time.monotonic())
        await asyncio.sleep(1.0)
        await asyncio.to_thread(engine.start)


async def run(args, url: str, key: str, engines: list[Engine]) -> dict:
    rng = random.Random(args.seed)
    low, high = (int(n) for n in args.tokens.split("-"))
    bodies = []
    for i in range(args.streams):
        messages = [{"role": "user", "content": f"stream {i} of the continuation bench"}]
        bodies.append({"model": MODEL, "messages": messages, "stream": True, "max_tokens": rng.randint(low, high)})
    stop, kills = asyncio.Event(), []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        shooting = asyncio.ensure_future(killer(engines, args.kill_every, stop, rng, kills))
        began = time.monotonic()
        results = await asyncio.gather(*(one_stream(session, url, body) for body in bodies))
        took = time.monotonic() - began
        stop.set()
        await shooting
    ok = [ended and text == expected_text(body) for (ended, text), body in zip(results, bodies, strict=True)]
    wrong = sum(ended and text != expected_text(body) for (ended, text), body in zip(results, bodies, strict=True))
    tokens = sum(body["max_tokens"] for body in bodies)
    return {"complete": sum(ok), "wrong": wrong, "seconds": took, "kills": len(kills), "tokens": tokens}


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


def quantile(buckets: list, q: float) -> str:
    """The bucket bound within which a `q` share of the gaps fall."""
    total = buckets[-1][1] if buckets else 0
    for bound, count in buckets:
        if total and count >= q * total:
            return f"≤ {bound * 1000:g} ms"
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
    args = parser.parse_args()
    os.environ["LLMGW_STREAM_MIGRATIONS"] = str(args.migrations)
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-continuation-"))
    engines = [Engine(args.token_delay_ms) for _ in range(args.replicas)]
    for engine in engines:
        engine.start()
    urls = [f"http://127.0.0.1:{engine.port}" for engine in engines]
    router, url, key = router_only(workdir, MODEL, args.way, urls)
    try:
        found = asyncio.run(run(args, url, key, engines))
        outcomes, buckets = router_figures(url)
    finally:
        router.terminate()
        router.wait(10)
        for engine in engines:
            engine.kill()
    n = args.streams
    print("| streams | complete | wrong text | engines killed | tokens | seconds | continuations | gap p50 | gap p99 |")
    print("|---:|---:|---:|---:|---:|---:|---|---|---|")
    continued = ", ".join(f"{reason}/{outcome}: {count}" for (reason, outcome), count in sorted(outcomes.items()))
    print(
        f"| {n} | {found['complete']} ({100 * found['complete'] / n:.2f}%) | {found['wrong']} | {found['kills']} "
        f"| {found['tokens']:,} | {found['seconds']:.1f} | {continued or '-'} | {quantile(buckets, 0.5)} "
        f"| {quantile(buckets, 0.99)} |"
    )
    return 0 if found["complete"] >= 0.999 * n and not found["wrong"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
