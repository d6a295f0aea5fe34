"""Instructions per request of the router and of the floor, counted by valgrind's callgrind: a figure that, unlike
CPU time on a shared 2-core machine, comes out the same run after run.

    .venv/bin/python bench/router_instructions.py [--requests 2000] [--concurrency 16] [--mode json,stream]
                                                  [--targets floor,router] [--key-features scope,limits]
                                                  [--keep DIR]

The builtin engine of `router_bench.py` answers; the floor (`floor_proxy.py`)
and the router (as `router_bench.py` serves it) each run under callgrind in
turn. After a warm-up, the counters are zeroed, `--requests` chat requests are
sent with `--concurrency` in flight, and the counters are dumped: the
instructions the process ran in between, divided by the requests. Start-up is
left out, and so is the load generator (another process). Under callgrind a
process runs some 50 times slower, so what is counted is the work per request,
not how it overlaps: compare targets with each other, not with CPU times.
With `--keep DIR` the dumps stay in DIR, to read per function:
`callgrind_annotate --inclusive=yes DIR/callgrind.router.<pid>.<n>`.
Needs valgrind (`apt-get install valgrind`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "router_bench.py"
sys.path.insert(0, str(ROOT / "bench"))

from router_bench import CHAT_BODY, KEY, free_port, wait_ready  # noqa: E402  (a sibling script, not a package)


async def send_requests(url: str, count: int, concurrency: int, stream: bool) -> int:
    """Send `count` chat requests, `concurrency` at a time; return how many failed."""
    body = {**CHAT_BODY, "stream": True} if stream else CHAT_BODY
    left, failed = count, 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, headers={"Authorization": f"Bearer {KEY}"}) as session:

        async def worker() -> None:
            nonlocal left, failed
            while left > 0:
                left -= 1
                async with session.post(url, json=body) as response:
                    await response.read()
                    failed += response.status != 200

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return failed


def dumped_instructions(out_prefix: str, pid: int) -> int:
    """The instruction count of the newest dump callgrind wrote for `pid`."""
    dumps = sorted(Path(out_prefix).parent.glob(f"{Path(out_prefix).name}.{pid}.*"), key=lambda p: p.stat().st_mtime)
    if not dumps:
        raise SystemExit(f"callgrind wrote no dump for process {pid}")
    found = re.search(r"^(?:summary|totals): (\d+)", dumps[-1].read_text(), re.MULTILINE)
    if found is None:
        raise SystemExit(f"no instruction total in {dumps[-1]}")
    return int(found.group(1))


def measure(target: str, command: list[str], url: str, args: argparse.Namespace, workdir: str) -> dict[str, int]:
    """Instructions per request of `command` (serving at `url`) for each mode."""
    out_prefix = f"{workdir}/callgrind.{target}"
    process = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_prefix}.%p", *command],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    figures = {}
    try:
        # A process under callgrind takes a minute or more to start, several on a loaded machine.
        asyncio.run(wait_ready(url.rsplit("/v1/", 1)[0] + "/health", timeout=900))
        for mode in args.mode.split(","):
            stream = mode == "stream"
            asyncio.run(send_requests(url, args.warmup, args.concurrency, stream))
            subprocess.run(["callgrind_control", "-z", str(process.pid)], check=True, capture_output=True)
            failed = asyncio.run(send_requests(url, args.requests, args.concurrency, stream))
            subprocess.run(["callgrind_control", "-d", str(process.pid)], check=True, capture_output=True)
            if failed:
                raise SystemExit(f"{target}: {failed} of {args.requests} {mode} requests failed")
            figures[mode] = dumped_instructions(out_prefix, process.pid) // args.requests
    finally:
        process.terminate()
        process.wait(30)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests counted per mode (default 2000)")
    parser.add_argument("--warmup", type=int, default=300, help="requests sent first, not counted (default 300)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    parser.add_argument("--mode", default="json,stream", help="json and/or stream (comma list)")
    parser.add_argument("--targets", default="floor,router", help="floor and/or router (comma list)")
    parser.add_argument("--key-features", default="scope,limits", help="the router's key (see router_bench.py)")
    parser.add_argument("--keep", metavar="DIR", help="keep callgrind's dumps in DIR (made if missing)")
    args = parser.parse_args()
    if args.requests < 1 or args.concurrency < 1 or args.warmup < 0:
        parser.error("--requests and --concurrency must be >= 1, --warmup >= 0")
    if not set(args.mode.split(",")) <= {"json", "stream"} or not set(args.targets.split(",")) <= {"floor", "router"}:
        parser.error("--mode takes json,stream and --targets floor,router")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("needs valgrind: apt-get install valgrind")

    engine_port = free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    engine = subprocess.Popen([sys.executable, str(BENCH), "--serve-engine", str(engine_port)], cwd=ROOT)
    results: dict[str, dict[str, int]] = {}
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llmgw-instructions-") as scratch:
        workdir = os.path.abspath(args.keep) if args.keep else scratch
        try:
            for target in args.targets.split(","):
                port = free_port()
                if target == "floor":
                    command = [sys.executable, str(ROOT / "bench" / "floor_proxy.py"), str(port), engine_url]
                else:
                    command = [sys.executable, str(BENCH), "--serve-router", str(port), "--upstream", engine_url]
                    command += ["--workdir", workdir, "--key-features", args.key_features]
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                results[target] = measure(target, command, url, args, workdir)
        finally:
            engine.terminate()
            engine.wait(10)
    print(f"instructions per request, {args.requests} requests, {args.concurrency} in flight, key {args.key_features}")
    print(f"{'mode':<7} " + " ".join(f"{t:>10}" for t in results) + ("   router vs floor" if len(results) == 2 else ""))
    for mode in args.mode.split(","):
        row = f"{mode:<7} " + " ".join(f"{results[t][mode]:>10,}" for t in results)
        if len(results) == 2:
            row += f"   {results['router'][mode] / results['floor'][mode] - 1:+.1%}"
        print(row)


if __name__ == "__main__":
    # The same string hashes in every run, so dict and set layouts (and so the counts) repeat.
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
