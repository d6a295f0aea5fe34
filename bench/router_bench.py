"""Router overhead benchmark: the same load straight at an engine, through the floor proxy, and through the router.

    .venv/bin/python bench/router_bench.py [--duration 10] [--concurrency 1,16,64] [--mode json,stream]
                                           [--engine mock|builtin] [--rounds 3]
    .venv/bin/python bench/router_bench.py --streams 1000 [--token-delay-ms 200] [--stream-tokens 16]

Four processes on 127.0.0.1: an engine (the bundled mock engine, or a minimal
aiohttp one built in here), the floor (`floor_proxy.py`: a raw ASGI app on
aiohttp, the least any Python proxy does), the router as production runs it
(uvicorn with uvloop + httptools, embedded hub, SQLite in a temporary
directory, one API key), and this load generator, which keeps `concurrency`
chat requests (JSON or streamed) in flight for `duration` seconds against each
target and prints requests/s, latency percentiles, the router/floor ratio and
each proxy's CPU time per request (from /proc: the shared cores distort it
less than throughput), with the router's CPU against the floor's. The targets
take `--rounds` turns each, alternating, and each figure is the median of its
rounds, so a change in the machine's load does not land on one target alone.
Each proxy runs in its own process so the load generator does not share its
interpreter.

`--streams N` instead opens N slow streams of `--stream-tokens` tokens through
the router at once (the mock engine answering a token every `--token-delay-ms`)
and reports errors and the router's peak resident memory, and that growth per
open stream (a continuable stream keeps what it relayed until it ends).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-model"
KEY = "sk-llmgw-bench-0123456789abcdef"
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}


# -- the processes under test ------------------------------------------------------------------


def serve_builtin_engine(port: int) -> None:
    """A minimal engine: a fixed chat completion, no delay, so the router's own cost dominates."""
    from aiohttp import web

    reply = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello."}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }

    chunk = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
    events = [
        b"data: "
        + json.dumps({**chunk, "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}).encode()
        + b"\n\n"
        for word in ("Hel", "lo", ".")
    ] + [b"data: [DONE]\n\n"]

    async def chat(request):
        body = await request.json()
        if not body.get("stream"):
            return web.json_response(reply)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", lambda request: web.json_response({"status": "ok"}))
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def serve_router(port: int, upstream: str, workdir: str, key_features: str = "", affinity: bool = True) -> None:
    """The router as production runs it, on an embedded hub holding an endpoint per engine (`upstream`: URLs,
    comma-separated); without `affinity`, balanced on load alone (bench/affinity_bench.py's baseline)."""
    os.environ.update(
        {
            "DATABASE_URL": f"sqlite:///{workdir}/bench.sqlite3",
            "SECRET_KEY": "bench-only",
            "LLMGW_HOME": workdir,
            "LOG_LEVEL": "WARNING",
            "DJANGO_SETTINGS_MODULE": "llmgw_site.settings",
        }
    )
    os.environ.pop("REDIS_URL", None)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command

    from hub import InProcessHub
    from hub.contracts import EndpointRow, EndpointTable, ModelEntry
    from keys.models import ApiKey
    from router.app import create_app
    from router.serving import GracefulServer, server_config

    call_command("migrate", "keys", verbosity=0)
    features = set(filter(None, key_features.split(",")))
    # A scoped and limited key exercises the scope check and the rate limiter on every request
    # (a limit no run reaches: the cost measured is the bookkeeping, not refusals).
    ApiKey.issue(
        "bench",
        key=KEY,
        allowed_models=[MODEL] if "scope" in features else [],
        rpm=10**9 if "limits" in features else None,
        tpm=10**12 if "limits" in features else None,
        # A key bound to the engine's pool, which the table lists for the model: the pools check runs in full.
        allowed_pools=["default"] if "pools" in features else [],
    )
    if not affinity:
        import router.app

        router.app.prefix_affinity = lambda payload: None  # the router as if prompts had no prefix
    hub = InProcessHub()
    entry = ModelEntry(pools=["default"]) if "pools" in features else ModelEntry()
    rows = [EndpointRow(replica_id=str(i), model=MODEL, url=url) for i, url in enumerate(upstream.split(","), 1)]
    hub.publish_endpoints(EndpointTable(models={MODEL: entry}, endpoints=rows))
    # Served as production serves it: the router's one server configuration.
    GracefulServer(server_config(create_app(hub), port=port, grace=settings.LLMGW_SHUTDOWN_GRACE_SECONDS)).run()


# -- the load generator -------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def wait_ready(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not become ready within {timeout:g} s")
            await asyncio.sleep(0.1)


async def drive(url: str, headers: dict, duration: float, concurrency: int, stream: bool = False) -> dict:
    """Keep `concurrency` requests in flight for `duration` seconds; return throughput and latencies."""
    body = {**CHAT_BODY, "stream": True} if stream else CHAT_BODY
    latencies: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + duration
    connector = aiohttp.TCPConnector(limit=concurrency)

    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def worker():
            nonlocal errors
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                try:
                    async with session.post(url, json=body) as response:
                        data = await response.read()
                        ok = response.status == 200 and (not stream or data.endswith(b"data: [DONE]\n\n"))
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - started)
                else:
                    errors += 1

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - began

    latencies.sort()

    def pct(p):
        return latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))] * 1000 if latencies else float("nan")

    return {
        "requests": len(latencies),
        "errors": errors,
        "rps": len(latencies) / elapsed,
        "p50_ms": pct(50),
        "p99_ms": pct(99),
    }


def summarise(runs: list[dict]) -> dict:
    """The median of each figure over a target's rounds (errors are summed)."""
    cpus = [r["cpu_us"] for r in runs if "cpu_us" in r]
    return {
        "rps": statistics.median(r["rps"] for r in runs),
        "p50_ms": statistics.median(r["p50_ms"] for r in runs),
        "p99_ms": statistics.median(r["p99_ms"] for r in runs),
        "errors": sum(r["errors"] for r in runs),
        "cpu_us": statistics.median(cpus) if cpus else None,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory (or its peak, VmHWM) in KiB, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


async def hold_streams(url: str, headers: dict, count: int, tokens: int = 16) -> dict:
    """Open `count` streams of `tokens` tokens at once and read each to its end; return errors and how long it took."""
    body = {**CHAT_BODY, "stream": True, "max_tokens": tokens, "messages": [{"role": "user", "content": "word " * 12}]}
    connector = aiohttp.TCPConnector(limit=0)
    errors = 0
    timeout = aiohttp.ClientTimeout(total=600)

    async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout) as session:

        async def one():
            nonlocal errors
            try:
                async with session.post(url, json=body) as response:
                    data = await response.read()
                    if response.status != 200 or not data.endswith(b"data: [DONE]\n\n"):
                        errors += 1
            except aiohttp.ClientError:
                errors += 1

        began = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(count)))
        return {"errors": errors, "seconds": time.perf_counter() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load per target (default 10)")
    parser.add_argument("--concurrency", default="1,16,64", help="requests kept in flight, a comma list")
    parser.add_argument("--mode", default="json,stream", help="json and/or stream (comma list)")
    parser.add_argument("--targets", default="direct,floor,router", help="which of direct, floor, router")
    parser.add_argument(
        "--rounds", type=int, default=3, help="turns each target takes; medians are printed (default 3)"
    )
    parser.add_argument("--streams", type=int, help="instead: hold this many slow streams through the router")
    parser.add_argument("--token-delay-ms", type=float, default=200.0, help="--streams: the mock engine's delay")
    parser.add_argument("--stream-tokens", type=int, default=16, help="--streams: each stream's tokens")
    has_mock = (ROOT / "agent" / "mock_engine.py").exists()
    parser.add_argument(
        "--engine",
        choices=["mock", "builtin"],
        default="mock" if has_mock else "builtin",
        help="mockengine.server (default when present) or a minimal aiohttp engine",
    )
    parser.add_argument("--serve-engine", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-router", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--no-affinity", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--key-features", default="", help="the router's key: scope, limits and/or pools (comma list; default none)"
    )
    args = parser.parse_args()
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency must be a comma list of numbers, not {args.concurrency!r}")
    modes = args.mode.split(",")
    targets = args.targets.split(",")
    if args.duration <= 0 or min(levels) < 1 or args.rounds < 1:
        parser.error("--duration must be > 0, every --concurrency >= 1 and --rounds >= 1")
    if not set(modes) <= {"json", "stream"} or not set(targets) <= {"direct", "floor", "router"}:
        parser.error("--mode takes json,stream and --targets direct,floor,router")

    if args.serve_engine:
        return serve_builtin_engine(args.serve_engine)
    if args.serve_router:
        return serve_router(args.serve_router, args.upstream, args.workdir, args.key_features, not args.no_affinity)

    engine_port, floor_port, router_port = free_port(), free_port(), free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    urls = {
        "direct": engine_url,
        "floor": f"http://127.0.0.1:{floor_port}",
        "router": f"http://127.0.0.1:{router_port}",
    }
    if args.engine == "mock" or args.streams:
        engine_cmd = [sys.executable, "-m", "mockengine", "--port", str(engine_port), "--model", MODEL]
        if args.streams:
            # Greedy mode: an answer of exactly max_tokens tokens, whatever the prompt.
            engine_cmd += ["--token-delay-ms", str(args.token_delay_ms), "--greedy"]
    else:
        engine_cmd = [sys.executable, __file__, "--serve-engine", str(engine_port)]
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as workdir:
        router_cmd = [sys.executable, __file__, "--serve-router", str(router_port), "--upstream", engine_url]
        router_cmd += ["--workdir", workdir, "--key-features", args.key_features]
        floor_cmd = [sys.executable, str(ROOT / "bench" / "floor_proxy.py"), str(floor_port), engine_url]
        processes = {
            "engine": subprocess.Popen(engine_cmd, cwd=ROOT),
            "floor": subprocess.Popen(floor_cmd, cwd=ROOT),
            "router": subprocess.Popen(router_cmd, cwd=ROOT),
        }
        key = {"Authorization": f"Bearer {KEY}"}
        try:
            for name in ("direct", "router"):
                asyncio.run(wait_ready(f"{urls[name]}/health"))
            if args.streams:
                router_pid = processes["router"].pid
                before = rss_kib(router_pid)
                url = f"{urls['router']}/v1/chat/completions"
                r = asyncio.run(hold_streams(url, key, args.streams, args.stream_tokens))
                peak = rss_kib(router_pid, "VmHWM")
                print(
                    f"{args.streams} streams of {args.stream_tokens} tokens through one router process "
                    f"({args.token_delay_ms:g} ms a token): {r['errors']} errors in {r['seconds']:.1f} s; router RSS "
                    f"{before / 1024:.0f} MB before, peak {peak / 1024:.0f} MB: "
                    f"{(peak - before) / args.streams:.1f} KiB per open stream"
                )
                return
            print(f"engine={args.engine} duration={args.duration:g}s rounds={args.rounds} cpus={os.cpu_count()}")
            print(
                f"{'mode':<6} {'conns':>5} {'target':<7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} "
                f"{'CPU us/req':>10} {'vs floor':>8} {'CPU vs floor':>12}"
            )
            for mode in modes:
                for level in levels:
                    # Targets take turns, round after round, so a change in the machine's load falls on
                    # all of them; each figure is the median over the rounds.
                    runs: dict[str, list[dict]] = {name: [] for name in targets}
                    for _ in range(args.rounds):
                        for name in targets:
                            pid = processes[name].pid if name != "direct" else None
                            cpu_before = cpu_seconds(pid) if pid else 0.0
                            headers = key if name == "router" else {}
                            url = f"{urls[name]}/v1/chat/completions"
                            r = asyncio.run(drive(url, headers, args.duration, level, stream=mode == "stream"))
                            if pid:
                                r["cpu_us"] = (cpu_seconds(pid) - cpu_before) / max(r["requests"], 1) * 1e6
                            runs[name].append(r)
                    floor = summarise(runs["floor"]) if "floor" in runs else None
                    for name in targets:
                        m = summarise(runs[name])
                        cpu = f"{m['cpu_us']:.0f}" if m["cpu_us"] is not None else "-"
                        ratio = cpu_ratio = "-"
                        if name == "router" and floor is not None:
                            ratio = f"{m['rps'] / floor['rps']:.2f}x"
                            if m["cpu_us"] is not None and floor["cpu_us"]:
                                cpu_ratio = f"{m['cpu_us'] / floor['cpu_us'] - 1:+.0%}"
                        print(
                            f"{mode:<6} {level:>5} {name:<7} {m['rps']:>8.0f} {m['p50_ms']:>8.2f} "
                            f"{m['p99_ms']:>8.2f} {m['errors']:>6} {cpu:>10} {ratio:>8} {cpu_ratio:>12}",
                            flush=True,
                        )
        finally:
            for process in processes.values():
                process.terminate()
            for process in processes.values():
                process.wait(10)


if __name__ == "__main__":
    main()
