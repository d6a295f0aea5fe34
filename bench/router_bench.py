"""Router overhead benchmark: the same load straight at an engine, then through the router.

    .venv/bin/python bench/router_bench.py [--duration 10] [--concurrency 32] [--engine mock|builtin]

Three processes on 127.0.0.1: an engine (the bundled mock engine, or a minimal
aiohttp one built in here), the router under uvicorn with uvloop + httptools
(embedded hub, SQLite in a temporary directory, one API key), and this load
generator, which keeps `concurrency` non-streaming chat requests in flight for
`duration` seconds against each target and prints requests/s and latency
percentiles. The router runs in its own process so the load generator does not
share its interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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

    async def chat(request):
        await request.read()
        return web.json_response(reply)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", lambda request: web.json_response({"status": "ok"}))
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def serve_router(port: int, upstream: str, workdir: str) -> None:
    """The router as production runs it, on an embedded hub holding one endpoint for the engine."""
    os.environ.update(
        {
            "DATABASE_URL": f"sqlite:///{workdir}/bench.sqlite3",
            "SECRET_KEY": "bench-only",
            "LLMGW_VAR_DIR": workdir,
            "LOG_LEVEL": "WARNING",
            "DJANGO_SETTINGS_MODULE": "llmgw_site.settings",
        }
    )
    os.environ.pop("REDIS_URL", None)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    import uvicorn
    from django.core.management import call_command

    from hub import InProcessHub
    from router.app import create_app
    from router.models import ApiKey

    call_command("migrate", "router", verbosity=0)
    ApiKey.issue("bench", key=KEY)
    hub = InProcessHub()
    hub.publish_endpoints(
        {
            "models": {MODEL: {"aliases": []}},
            "endpoints": [
                {"replica_id": "1", "model": MODEL, "url": upstream, "priority": 0, "weight": 1, "pool": "default"}
            ],
        }
    )
    uvicorn.run(
        create_app(hub),
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        proxy_headers=False,
    )


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


async def drive(url: str, headers: dict, duration: float, concurrency: int) -> dict:
    """Keep `concurrency` requests in flight for `duration` seconds; return throughput and latencies."""
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
                    async with session.post(url, json=CHAT_BODY) as response:
                        await response.read()
                        ok = response.status == 200
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load per target (default 10)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests kept in flight (default 32)")
    has_mock = (ROOT / "agent" / "mock_engine.py").exists()
    parser.add_argument(
        "--engine",
        choices=["mock", "builtin"],
        default="mock" if has_mock else "builtin",
        help="agent.mock_engine (default when present) or a minimal aiohttp engine",
    )
    parser.add_argument("--serve-engine", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-router", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.duration <= 0 or args.concurrency < 1:
        parser.error("--duration must be > 0 and --concurrency >= 1")

    if args.serve_engine:
        return serve_builtin_engine(args.serve_engine)
    if args.serve_router:
        return serve_router(args.serve_router, args.upstream, args.workdir)

    engine_port, router_port = free_port(), free_port()
    engine_url, router_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{router_port}"
    if args.engine == "mock":
        engine_cmd = [sys.executable, "-m", "agent.mock_engine", "--port", str(engine_port), "--model", MODEL]
    else:
        engine_cmd = [sys.executable, __file__, "--serve-engine", str(engine_port)]
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as workdir:
        router_cmd = [
            sys.executable,
            __file__,
            "--serve-router",
            str(router_port),
            "--upstream",
            engine_url,
            "--workdir",
            workdir,
        ]
        processes = [subprocess.Popen(engine_cmd, cwd=ROOT), subprocess.Popen(router_cmd, cwd=ROOT)]
        try:
            asyncio.run(wait_ready(f"{engine_url}/health"))
            asyncio.run(wait_ready(f"{router_url}/health"))
            print(
                f"engine={args.engine} concurrency={args.concurrency} duration={args.duration:g}s cpus={os.cpu_count()}"
            )
            print(
                f"{'target':<8} {'requests':>9} {'errors':>7} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
                f"{'router CPU us/req':>18}"
            )
            router_pid = processes[1].pid
            for name, url, headers in (
                ("direct", engine_url, {}),
                ("router", router_url, {"Authorization": f"Bearer {KEY}"}),
            ):
                cpu_before = cpu_seconds(router_pid)
                r = asyncio.run(drive(f"{url}/v1/chat/completions", headers, args.duration, args.concurrency))
                # The router's own CPU per proxied request: a figure the shared cores do not distort.
                per_request = (cpu_seconds(router_pid) - cpu_before) / max(r["requests"], 1) * 1e6
                shown = f"{per_request:.0f}" if name == "router" else "-"
                print(
                    f"{name:<8} {r['requests']:>9} {r['errors']:>7} {r['rps']:>9.0f} "
                    f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {shown:>18}",
                    flush=True,
                )
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(10)


if __name__ == "__main__":
    main()
