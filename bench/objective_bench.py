"""Objective scaling: a load that ramps 2 → 10 → 1 requests a second, on mock engines that take 100 s to start.

`manage.py up --demo` with one model on mock engines of a fixed capacity (`max_concurrency` 4, the mock's batch; each
token 100 ms, 25% slower per other request running, as a GPU's decode step grows with its batch) and a simulated start
(`--load-seconds`). Streamed chat requests (10 tokens) arrive as a Poisson process whose rate follows the ramp:

    2/s for 200 s, up to 10/s over 200 s, 10/s for 200 s, down to 1/s over 100 s, 1/s for 300 s

Once with the profile's objectives (p90 time to first token and p90 gap between tokens; min 1 replica), then with
static fleets of N replicas (no objectives, never scaled). Each run prints the share of requests whose first token
(as the client sees it) came within the TTFT objective, and the replica-seconds: engine processes alive (a starting
one holds its GPU) integrated over the load.

`--time-scale` shortens every duration but the requests' own (the ramp, the start, the scaling delays, the window,
the idle timeout), so a run takes 1000 s × scale: the figures to compare are the ratios between runs of one scale.

    .venv/bin/python bench/objective_bench.py                          # objectives, then static 3, 4 and 5
    .venv/bin/python bench/objective_bench.py --time-scale 0.25 --static 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import httpx  # noqa: E402

from tests.e2e.demo_stack import API_KEY, catalog_stack, engine_pids  # noqa: E402

MODEL = "ramp"
# (seconds, requests a second at the start, at the end): linear in between.
RAMP = [(200, 2, 2), (200, 2, 10), (200, 10, 10), (100, 10, 1), (300, 1, 1)]
TOKENS = 10
EMPTY = re.compile(rb'"content":\s*""')


def catalog(args, static: int | None) -> str:
    engine_args = [
        "--load-seconds",
        f"{100 * args.time_scale:g}",
        "--token-delay-ms",
        "100",
        "--batch-slowdown",
        "0.25",
    ]
    if static is None:
        fields = (
            f"min_replicas: 1, max_replicas: {args.max_replicas}, ttft_objective_seconds: {args.ttft_objective}, "
            f"itl_objective_seconds: {args.itl_objective}, idle_timeout_seconds: {round(120 * args.time_scale)}"
        )
    else:
        fields = f"min_replicas: {static}, max_replicas: {static}, target_concurrency: 1000, idle_timeout_seconds: 0"
    return (
        "models:\n"
        f"  - name: {MODEL}\n"
        f"    source: org/{MODEL}\n"
        "    profiles:\n"
        f"      - {{engine: mock, gpu_class: H100-80GB, gpus_per_node: 1, max_concurrency: 4, {fields},\n"
        f"         engine_args: {json.dumps(engine_args)}}}\n"
    )


class Replicas:
    """Engine processes of the stack, sampled every 0.25 s: replica-seconds, and how many ran over time."""

    def __init__(self, var_dir: Path):
        self.var_dir, self.samples = var_dir, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), len(engine_pids(self.var_dir))))
            time.sleep(0.25)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def seconds(self, start: float, end: float) -> float:
        total = 0.0
        for (t, count), (t_next, _) in zip(self.samples, self.samples[1:], strict=False):
            total += count * max(0.0, min(t_next, end) - max(t, start))
        return total

    def at(self, t: float) -> int:
        return next((count for when, count in reversed(self.samples) if when <= t), 0)


@dataclass
class Outcome:
    sent: float
    first: float | None = None
    status: int | str | None = None


@dataclass
class Run:
    label: str
    outcomes: list[Outcome] = field(default_factory=list)
    replica_seconds: float = 0.0
    timeline: list[int] = field(default_factory=list)
    duration: float = 0.0

    def within(self, objective: float) -> float:
        ok = sum(1 for o in self.outcomes if o.status == 200 and o.first is not None and o.first - o.sent <= objective)
        return ok / len(self.outcomes)


def rate_at(t: float, scale: float) -> float:
    for seconds, start, end in RAMP:
        length = seconds * scale
        if t < length:
            return start + (end - start) * t / length
        t -= length
    return RAMP[-1][2]


async def one(session: aiohttp.ClientSession, router: str, rng: random.Random, outcome: Outcome) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"ramp {rng.random()}"}],
        "max_tokens": TOKENS,
        "stream": True,
    }
    try:
        async with session.post(f"{router}/v1/chat/completions", json=body) as reply:
            outcome.status = reply.status
            async for line in reply.content:
                text = outcome.first is None and line.startswith(b"data: {") and b'"content"' in line
                if text and not EMPTY.search(line):
                    outcome.first = time.monotonic()  # the first text, not the role's empty chunk
    except aiohttp.ClientError as exc:
        outcome.status = type(exc).__name__


async def ramp(router: str, scale: float, seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    total = sum(seconds for seconds, _, _ in RAMP) * scale
    outcomes: list[Outcome] = []
    tasks = []
    headers = {"Authorization": f"Bearer {API_KEY}"}
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        began = time.monotonic()
        while (now := time.monotonic()) - began < total:
            outcome = Outcome(now)
            outcomes.append(outcome)
            tasks.append(asyncio.create_task(one(s, router, rng, outcome)))
            await asyncio.sleep(rng.expovariate(rate_at(now - began, scale)))
        await asyncio.gather(*tasks)
    return outcomes


def wait_for_replicas(var: Path, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(engine_pids(var)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} engines did not start within {timeout:g} s")
        time.sleep(0.5)


def wait_serving(router: str, timeout: float) -> None:
    """Until a request is answered (the first replica ready)."""
    deadline = time.monotonic() + timeout
    body = {"model": MODEL, "messages": [{"role": "user", "content": "up?"}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    while time.monotonic() < deadline:
        try:
            if httpx.post(f"{router}/v1/chat/completions", json=body, headers=headers, timeout=600).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("the model did not serve")


def run(args, static: int | None) -> Run:
    scale = args.time_scale
    env = {
        "LLMGW_SCALE_OUT_AFTER_SECONDS": f"{10 * scale:g}",
        "LLMGW_LATENCY_WINDOW_SECONDS": f"{max(1.0, 60 * scale):g}",
        "LLMGW_ACTIVATION_TIMEOUT_SECONDS": "600",
        "LLMGW_HEARTBEAT_SECONDS": "1",
        **({"LLMGW_OBJECTIVE_SCALE_UP": str(args.up)} if args.up else {}),
        **({"LLMGW_OBJECTIVE_SCALE_DOWN": str(args.down)} if args.down else {}),
    }
    label = "objectives" if static is None else f"static {static}"
    with tempfile.TemporaryDirectory() as tmp:
        var = Path(tmp)
        with catalog_stack(var, catalog(args, static), env=env) as stack:
            router = stack["router"]
            replicas = Replicas(var)
            replicas.start()
            wait_for_replicas(var, static or 1, 120 + 200 * scale)
            wait_serving(router, 120 + 200 * scale)
            if static:  # a static fleet is there before the load: every replica serving
                time.sleep(100 * scale + 5)
            began = time.monotonic()
            outcomes = asyncio.run(ramp(router, scale, args.seed))
            ended = time.monotonic()
            replicas.stop()
            step = (ended - began) / 20
            timeline = [replicas.at(began + step * i) for i in range(21)]
            result = Run(label, outcomes, replicas.seconds(began, ended), timeline, ended - began)
            if args.keep_logs:  # the control plane's scaling decisions, for reading afterwards
                Path(args.keep_logs, f"{label.replace(' ', '-')}.log").write_text(stack["log"].read_text())
    return result


def report(runs: list[Run], objective: float) -> None:
    static = [r for r in runs if r.label.startswith("static")]
    sized = next((r for r in sorted(static, key=lambda r: r.replica_seconds) if r.within(objective) >= 0.95), None)
    print(f"\nTTFT objective {objective:g} s (client-side first token); replica-seconds over the load")
    print("| fleet | requests | within objective | failed | replica-seconds | vs static sized for the peak |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in runs:
        failed = sum(1 for o in r.outcomes if o.status != 200)
        share = f"{r.replica_seconds / sized.replica_seconds:.0%}" if sized else "-"
        print(
            f"| {r.label} | {len(r.outcomes)} | {r.within(objective):.1%} | {failed} | {r.replica_seconds:,.0f} | "
            f"{share} |"
        )
    for r in runs:
        print(f"{r.label}: engines over the load (21 samples): {r.timeline}")
    if sized is None:
        print("no static fleet run reached 95% within the objective")
    else:
        print(f"static fleet sized for the peak: {sized.label}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--ttft-objective", type=float, default=0.5)
    parser.add_argument("--itl-objective", type=float, default=0.18)
    parser.add_argument("--max-replicas", type=int, default=8)
    parser.add_argument("--static", type=int, nargs="*", default=[3, 4, 5], help="static fleet sizes to compare")
    parser.add_argument("--no-objectives", action="store_true", help="only the static fleets")
    parser.add_argument("--up", type=float, help="LLMGW_OBJECTIVE_SCALE_UP (default: the setting's)")
    parser.add_argument("--down", type=float, help="LLMGW_OBJECTIVE_SCALE_DOWN (default: the setting's)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep-logs", metavar="DIR", help="keep each run's control-plane log in DIR")
    args = parser.parse_args()
    runs = [] if args.no_objectives else [run(args, None)]
    if runs:
        report(runs, args.ttft_objective)
    for size in args.static:
        runs.append(run(args, size))
        report(runs, args.ttft_objective)


if __name__ == "__main__":
    main()
