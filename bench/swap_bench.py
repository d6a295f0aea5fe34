"""Swaps: stop/start against the hibernate tier on more models than slots.

`manage.py up --demo` with a catalog of three models that each need a whole
H100 node (the demo has two), every engine a mock told to take `--load-seconds`
to start and `--wake-seconds` to wake. The trace "A B A A C A B C" × N is sent
one request at a time, then the same demand from three concurrent clients; once
with `sleep_level: 0` (stop and cold start, as before the hibernate tier) and
once with sleep allowed. Prints, per mode: total time, cold starts after the
first of each model (engine processes launched), the p95 wait of a request to
a sleeping model (time to its first token), swaps (wakes) and failed requests.

    .venv/bin/python bench/swap_bench.py                      # both modes, 20 s loads, 1 s wakes
    .venv/bin/python bench/swap_bench.py --modes hibernate --repeat 1
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.e2e.demo_stack import API_KEY, demo_stack, engine_pids  # noqa: E402

TRACE = ["A", "B", "A", "A", "C", "A", "B", "C"]
MODELS = {"A": "alpha", "B": "beta", "C": "gamma"}


def catalog(sleep_level: int | None, load: float, wake: float) -> str:
    level = "" if sleep_level is None else f", sleep_level: {sleep_level}"
    args = f'["--load-seconds", "{load}", "--wake-seconds", "{wake}"]'
    lines = ["models:"]
    for name in MODELS.values():
        lines += [
            f"  - name: {name}",
            f"    source: org/{name}",
            "    profiles:",
            f"      - {{engine: mock, gpu_class: H100-80GB, gpus_per_node: 8, idle_timeout_seconds: 0{level},",
            f"         engine_args: {args}}}",
        ]
    return "\n".join(lines) + "\n"


class Launches:
    """Engine processes seen for this stack, sampled every 0.1 s: each new pid is a cold start."""

    def __init__(self, var_dir: Path):
        self.var_dir, self.seen, self._stop = var_dir, set(), threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self):
        while not self._stop.is_set():
            self.seen |= engine_pids(self.var_dir)
            time.sleep(0.1)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return len(self.seen)


def ask(client: httpx.Client, model: str) -> tuple[float, bool]:
    """One streamed chat completion: (seconds to its first token, whether it succeeded)."""
    began = time.monotonic()
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                return time.monotonic() - began, False
            first = None
            for line in reply.iter_lines():
                if first is None and line.startswith("data:") and '"content"' in line:
                    first = time.monotonic() - began
            return (first if first is not None else time.monotonic() - began), True
    except httpx.HTTPError:
        return time.monotonic() - began, False


class Status:
    """Which models sleep, read from the REST API (tens of ms, so the trace stays back to back; a
    `ctl_status` process would take a second, time in which occupants become idle and resident)."""

    def __init__(self, stack: dict):
        token = subprocess.run(
            [sys.executable, "manage.py", "create_api_token", "admin"],
            cwd=ROOT, env=stack["env"], capture_output=True, text=True, timeout=60, check=True,
        ).stdout.strip()  # fmt: skip
        self.client = httpx.Client(
            base_url=f"http://127.0.0.1:{stack['port']}/api/v1", headers={"Authorization": f"Bearer {token}"}
        )

    def asleep_models(self) -> set[str]:
        rows = self.client.get("/replicas/", params={"state": "sleeping", "page_size": 100}).json()["results"]
        return {r["model"] for r in rows}


def run_mode(mode: str, args) -> dict:
    sleep_level = 0 if mode == "stop/start" else None
    with tempfile.TemporaryDirectory() as tmp:
        var = Path(tmp)
        (var / "catalog.yaml").write_text(catalog(sleep_level, args.load_seconds, args.wake_seconds))
        env = {
            "LLMGW_EVICT_MIN_IDLE_SECONDS": str(args.min_idle),
            "LLMGW_MIN_RESIDENCY_SECONDS": str(args.residency),
            "LLMGW_HEARTBEAT_SECONDS": "1",
            "LLMGW_ACTIVATION_TIMEOUT_SECONDS": "600",
        }
        with demo_stack(var, "--catalog", str(var / "catalog.yaml"), env=env) as stack:
            headers = {"Authorization": f"Bearer {API_KEY}"}
            launches = Launches(var)
            client = httpx.Client(base_url=stack["router"], headers=headers, timeout=600)
            status = Status(stack)
            sleeping_waits, failed, looking = [], 0, 0.0
            began = time.monotonic()
            for _ in range(args.repeat):
                for letter in TRACE:
                    model = MODELS[letter]
                    look = time.monotonic()
                    was_asleep = model in status.asleep_models()
                    looking += time.monotonic() - look  # the bench's own status reads are not the swap's time
                    wait, ok = ask(client, model)
                    failed += not ok
                    if was_asleep:
                        sleeping_waits.append(wait)
            sequential = time.monotonic() - began - looking
            wakes_before = stack["log"].read_text().count("waking replicas")
            began = time.monotonic()
            with ThreadPoolExecutor(3) as pool:
                clients = [httpx.Client(base_url=stack["router"], headers=headers, timeout=600) for _ in range(3)]
                jobs = [
                    pool.submit(lambda c, t: [ask(c, MODELS[x]) for x in t], clients[i], TRACE * args.repeat)
                    for i in range(3)
                ]
                concurrent = [result for job in jobs for result in job.result()]
            failed += sum(not ok for _, ok in concurrent)
            log = stack["log"].read_text()
            engines = launches.stop()
            return {
                "mode": mode,
                "sequential_s": sequential,
                "concurrent_s": time.monotonic() - began,
                "cold_starts_after_first": engines - len(MODELS),
                "p95_sleeping_wait_s": _p95(sleeping_waits),
                "sleeping_waits_s": " ".join(f"{w:.1f}" for w in sorted(sleeping_waits)) or None,
                "sleeping_requests": len(sleeping_waits),
                "swaps_sequential": wakes_before,
                "swaps_concurrent": log.count("waking replicas") - wakes_before,
                "failed": failed,
            }


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    if len(values) < 20:
        return max(values)
    return statistics.quantiles(values, n=20)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="stop/start,hibernate")
    parser.add_argument("--repeat", type=int, default=4, help="times the trace is sent (default 4)")
    parser.add_argument("--load-seconds", type=float, default=20.0)
    parser.add_argument("--wake-seconds", type=float, default=1.0)
    parser.add_argument("--min-idle", type=float, default=1.0, help="LLMGW_EVICT_MIN_IDLE_SECONDS (default 1)")
    parser.add_argument("--residency", type=float, default=5.0, help="LLMGW_MIN_RESIDENCY_SECONDS (default 5)")
    args = parser.parse_args()
    rows = [run_mode(mode.strip(), args) for mode in args.modes.split(",")]
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(_fmt(row[k]) for k in keys) + " |")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.1f}"
    return "-" if value is None else str(value)


if __name__ == "__main__":
    main()
