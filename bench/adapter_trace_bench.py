"""LoRA adapters under a trace, on the real stack: loads against a least-recently-used oracle, and the first
token of an adapter not loaded, with llmgw's own share of it.

    .venv/bin/python bench/adapter_trace_bench.py [--adapters 50] [--requests 400] [--load-seconds 0.5]

`manage.py up --demo` runs with a catalog of one base model (mock engine, two replicas: one per 8×H100 node,
8 adapter slots each, a load taking `--load-seconds`) and `--adapters` adapters on it. Then:

* **first token**: with every adapter unloaded, one streamed chat per adapter for `--first` adapters in turn;
  the time to the first token, minus the load time the agent reports, is llmgw's overhead. Its parts, from the
  log's timestamps: hold → assignment (the request reaching the router until the tick that sends the load),
  command (until the agent starts loading), load, and publish → first token (the agent's answer until the
  token reaches the client);
* **trace**: `--requests` chat requests, `--concurrency` at a time, naming adapters drawn from a Zipf
  distribution (exponent `--zipf`, seed `--seed`); every request must be answered 200. The loads llmgw made
  (the tick's "loading adapter" lines) are compared with the misses of two least-recently-used oracles
  replaying the same sequence: one cache of all 16 slots (the best any placement could do with LRU), and
  per-replica caches of 8 with each adapter on its rendezvous-hash replica (what llmgw's assignment aims at).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-llmgw-bench-trace-0123456789"
SLOTS = 8


def catalog(adapters: int, load_seconds: float) -> str:
    lines = [
        "models:",
        "  - name: base",
        "    source: org/base",
        "    profiles:",
        "      - engine: mock",
        "        gpu_class: H100-80GB",
        "        gpus_per_node: 8",
        "        min_replicas: 2",
        "        max_replicas: 2",
        f"        max_adapters: {SLOTS}",
        f'        engine_args: ["--lora-load-seconds", "{load_seconds}"]',
        "    adapters:",
    ]
    lines += [f"      - {{name: ft-{i:03d}, source: org/ft-{i:03d}}}" for i in range(adapters)]
    return "\n".join(lines) + "\n"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_stack(workdir: Path, catalog_text: str) -> tuple[subprocess.Popen, str, Path]:
    (workdir / "catalog.yaml").write_text(catalog_text)
    router_port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")} | {
        "LLMGW_HOME": str(workdir),
        "LLMGW_DEMO_API_KEY": KEY,
        "LLMGW_DEMO_ADMIN_PASSWORD": "bench-admin-password",
        "LLMGW_PORT": str(free_port()),
        "LLMGW_ROUTER_PORT": str(router_port),
        "LLMGW_TICK_SECONDS": "0.5",
        "PYTHONUNBUFFERED": "1",
    }
    log_path = workdir / "up.log"
    log = open(log_path, "w")  # noqa: SIM115 (the stack's whole life)
    cmd = [sys.executable, "manage.py", "up", "--demo", "--catalog", str(workdir / "catalog.yaml")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{router_port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(log_path.read_text())
        try:
            models = httpx.get(f"{base}/health", timeout=1).json()
            if models.get("endpoints", 0) >= 2:
                return proc, base, log_path
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("the stack did not serve two replicas within 90 s:\n" + log_path.read_text()[-3000:])


def stamp(line: str) -> float:
    """The Unix time of a log line (`2026-12-02 02:01:11,955 INFO …`)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def first_line(log_path: Path, pattern: str, after: float) -> tuple[float, str]:
    for line in log_path.read_text().splitlines():
        if re.search(pattern, line) and line[:4].isdigit() and stamp(line) >= after - 0.01:
            return stamp(line), line
    raise SystemExit(f"no log line matches {pattern!r}")


def first_token(base: str, log_path: Path, adapter: str) -> dict[str, float]:
    """One streamed chat to `adapter` (not loaded): time to first token and its parts, in ms."""
    body = {"model": adapter, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    sent = time.time()
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as response:
        assert response.status_code == 200, response.read()
        token = None
        for chunk in response.iter_lines():  # read to the end; the first content chunk is the first token
            if token is None and chunk.startswith("data: {") and '"content"' in chunk:
                token = time.time()
        assert token is not None, "no token streamed"
    time.sleep(0.3)  # the log is written by another process
    assigned, _ = first_line(log_path, rf"loading adapter {adapter} onto replica", sent)
    loading, _ = first_line(log_path, rf"loading adapter {adapter} from", sent)
    answered, line = first_line(log_path, rf"adapter {adapter} loaded", sent)
    took = re.search(r"in ([0-9.]+) s", line)
    load = float(took.group(1)) if took else answered - loading
    return {
        "first token": (token - sent) * 1000,
        "hold → assignment": (assigned - sent) * 1000,
        "command": (loading - assigned) * 1000,
        "load": load * 1000,
        "answer → first token": (token - loading - load) * 1000,
        "overhead": (token - sent - load) * 1000,
    }


def lru_misses(sequence: list[str], capacity: int, cache_of=lambda name: 0) -> int:
    caches: dict[int, collections.OrderedDict] = collections.defaultdict(collections.OrderedDict)
    misses = 0
    for name in sequence:
        cache = caches[cache_of(name)]
        if name in cache:
            cache.move_to_end(name)
            continue
        misses += 1
        cache[name] = True
        if len(cache) > capacity:
            cache.popitem(last=False)
    return misses


def run_trace(base: str, names: list[str], concurrency: int) -> tuple[int, list[str], float]:
    """(errors, their first lines, seconds) of one chat per name, `concurrency` at a time, in order of issue."""
    errors: list[str] = []

    def one(name: str) -> None:
        body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        try:
            response = httpx.post(
                f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
            )
            if response.status_code != 200:
                errors.append(f"{name}: {response.status_code} {response.text[:200]}")
        except httpx.HTTPError as exc:
            errors.append(f"{name}: {exc!r}")

    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, names))
    return len(errors), errors[:5], time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=50)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--load-seconds", type=float, default=0.5)
    parser.add_argument("--first", type=int, default=5, help="adapters timed for their first token")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="llmgw-adapter-trace-"))
    proc, base, log_path = start_stack(workdir, catalog(args.adapters, args.load_seconds))
    try:
        names = [f"ft-{i:03d}" for i in range(args.adapters)]
        runs = [first_token(base, log_path, name) for name in names[: args.first]]
        print(f"first token of an adapter not loaded (mock load {args.load_seconds} s), median of {len(runs)}:")
        for part in runs[0]:
            values = [run[part] for run in runs]
            print(f"  {part:<22} {statistics.median(values):8.0f} ms   (max {max(values):.0f})")

        rng = random.Random(args.seed)
        weights = [1 / (rank + 1) ** args.zipf for rank in range(args.adapters)]
        sequence = rng.choices(names, weights, k=args.requests)
        placed = re.compile(r"loading adapter ft-\d+ onto replica")
        before = len(placed.findall(log_path.read_text()))
        errors, samples, seconds = run_trace(base, sequence, args.concurrency)
        time.sleep(1.0)
        text = log_path.read_text()
        loads = len(placed.findall(text)) - before  # the trace's own, not the first-token phase's
        replicas = sorted(set(re.findall(r"onto replica (\d+)", text)))
        home = {name: max(replicas, key=lambda r, n=name: zlib.crc32(f"{n}/{r}".encode())) for name in names}
        print(f"trace: {args.requests} requests over {args.adapters} adapters (zipf {args.zipf}, seed {args.seed}), "
              f"{args.concurrency} at a time, {seconds:.1f} s: {errors} errors")  # fmt: skip
        for sample in samples:
            print("  ", sample)
        print(f"  loads by llmgw:                         {loads}")
        print(f"  LRU oracle, one cache of {2 * SLOTS} slots:       {lru_misses(sequence, 2 * SLOTS)}")
        print(f"  LRU oracle, {SLOTS} slots on each rendezvous home: {lru_misses(sequence, SLOTS, home.get)}")
    finally:
        proc.kill()
        proc.wait(10)


if __name__ == "__main__":
    main()
