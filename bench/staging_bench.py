"""Staged weights on a real fleet: the hub asked once, peers copying at loopback speed, and cold starts compared.

Three agents (one fake GPU each) under `manage.py up`, the mock hub throttled to `--hub-rate` for all of its
clients together, a model of `--size` bytes of random safetensors. In one run:

1. `loopback`: one shard copied over HTTP on 127.0.0.1 (the weights server's own aiohttp file response, read
   by httpx to disk and hashed, as staging does), alone and two at once: what this machine's loopback copies
   measure, best of three;
2. `hub once`: model A wanted on one node (min 1): staged from the hub; then asked on every node
   (`prefetch_nodes: 3`): the other two copy from the first at once, each at its peer rate; the hub's bytes;
3. `cold start, staged`: model B, on no node, wanted by two nodes at once (min 2), a streamed request sent at
   the same moment: seconds to its first token, and until both replicas serve; the hub's bytes;
4. `resume`: model C staged from the hub on one node (prefetched), whose agent is killed about halfway and
   started again;
5. `cold start, engines download`: the same as 3 on a fresh fleet with staging off (LLMGW_STAGE_ENGINES empty) and
   each engine downloading B itself before serving (the mock engine's --download-weights, as vLLM does).

    .venv/bin/python bench/staging_bench.py [--size 2e9] [--files 4] [--hub-rate 50e6] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import httpx
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conftest import wait_until  # noqa: E402
from mockhub.repos import make_safetensors_repo  # noqa: E402
from tests.e2e.staging_fleet import Fleet, staging_fleet  # noqa: E402

NODES = ["n1", "n2", "n3"]
PROFILE = "{{engine: mock, gpu_class: H100-80GB, gpus_per_node: 1, min_replicas: {min}, max_replicas: 3{extra}}}"


def catalog(models: dict[str, str]) -> str:
    lines = ["models:"]
    for name, profile in models.items():
        lines += [f"- name: {name}", f"  source: org/{name}", "  enabled: true", "  aliases: []", "  profiles:"]
        lines.append(f"  - {profile}")
    return "\n".join(lines) + "\n"


async def _loopback(path: Path, outs: list[Path]) -> list[float]:
    """Copy `path` over HTTP on 127.0.0.1 once per `outs` at the same time, hashed as staging hashes; each copy's
    bytes a second."""
    app = web.Application()
    app.router.add_get("/blob", lambda request: web.FileResponse(path, chunk_size=1 << 20))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def copy(out: Path) -> float:
        started, digest = time.monotonic(), hashlib.sha256()
        with httpx.Client() as client, client.stream("GET", f"http://127.0.0.1:{port}/blob") as r, open(out, "wb") as f:
            for chunk in r.iter_bytes():
                f.write(chunk)
                digest.update(chunk)
        return path.stat().st_size / (time.monotonic() - started)

    try:
        return list(await asyncio.gather(*(asyncio.to_thread(copy, out) for out in outs)))
    finally:
        await runner.cleanup()


def loopback(repo: Path, scratch: Path, rounds: int = 3) -> dict:
    """The best of `rounds` of one copy alone, and of two at once (as two peers copying from one node)."""
    shard = max(repo.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    outs = [scratch / "copy-1", scratch / "copy-2"]
    one = max(asyncio.run(_loopback(shard, outs[:1]))[0] for _ in range(rounds))
    two = max(min(asyncio.run(_loopback(shard, outs))) for _ in range(rounds))
    for out in outs:
        out.unlink(missing_ok=True)
    return {"file_bytes": shard.stat().st_size, "one_copy_MBps": one / 1e6, "each_of_two_copies_MBps": two / 1e6}


def stage_seconds(message: str) -> float | None:
    match = re.search(r"bytes in ([0-9.]+) s", message)
    return float(match[1]) if match else None


def ready_stages(fleet: Fleet, source: str) -> list[dict]:
    """The ready stages of `source`, read from the fleet's SQLite file: a poll costs no process, so the copies it
    waits for have the machine's cores to themselves (each stage times itself, agent-side)."""
    with sqlite3.connect(f"file:{fleet.var / 'llmgw.sqlite3'}?mode=ro", uri=True, timeout=30) as db:
        rows = db.execute(
            "SELECT n.name, s.message FROM inventory_weightsstage s JOIN inventory_node n ON n.id = s.node_id "
            "WHERE s.source = ? AND s.state = 'ready'",
            (source,),
        ).fetchall()
    return [{"node": node, "message": message} for node, message in rows]


def hub_once(fleet: Fleet, size: int) -> dict:
    fleet.apply(catalog({"a": PROFILE.format(min=1, extra="")}))
    first = wait_until(lambda: ready_stages(fleet, "org/a"), 1800, 1.0, describe=fleet.log)[0]
    fleet.apply(catalog({"a": PROFILE.format(min=1, extra=", prefetch_nodes: 3")}))
    copies = wait_until(lambda: (s := ready_stages(fleet, "org/a")) and len(s) == 3 and s, 1800, 1.0)
    peers = {s["node"]: s for s in copies if s["node"] != first["node"]}
    hub_bytes = sum(n for path, n in fleet.hub_stats()["served"].items() if path.startswith("org/a/"))
    return {
        "from_hub": {"node": first["node"], "seconds": stage_seconds(first["message"])},
        "copies": {
            node: {
                "seconds": (t := stage_seconds(s["message"])),
                "MBps": size / t / 1e6 if t else None,
                "message": s["message"],
            }
            for node, s in sorted(peers.items())
        },  # fmt: skip
        "hub_bytes": hub_bytes,
        "model_bytes": size,
    }


def fetching(fleet: Fleet, source: str, past: int) -> tuple[str, int] | None:
    """A node fetching `source` with more than `past` bytes done, and how many (read from the database)."""
    with sqlite3.connect(f"file:{fleet.var / 'llmgw.sqlite3'}?mode=ro", uri=True, timeout=30) as db:
        row = db.execute(
            "SELECT n.name, s.bytes_done FROM inventory_weightsstage s JOIN inventory_node n ON n.id = s.node_id "
            "WHERE s.source = ? AND s.state = 'fetching' AND s.bytes_done > ?",
            (source, past),
        ).fetchone()
    return (row[0], row[1]) if row else None


def resume(fleet: Fleet, size: int) -> dict:
    """Model c staged from the hub on one node whose agent is killed (SIGKILL) about halfway and started again:
    asked for again once quiet (LLMGW_STAGE_STALL_SECONDS), the stage resumes from its partial files."""
    # Prefetched (no replica: every GPU serves a or b by now), so it is staged on the first node by name.
    fleet.apply(catalog({"c": PROFILE.format(min=0, extra=", prefetch_nodes: 1")}))
    node, done = wait_until(lambda: fetching(fleet, "org/c", size // 2), 1800, 0.5, describe=fleet.log)
    killed = time.monotonic()
    fleet.agents[node].kill()
    fleet.agents[node].wait(10)
    fleet.start_agent(node)
    ready = wait_until(lambda: ready_stages(fleet, "org/c"), 1800, 1.0, describe=fleet.log)
    hub_bytes = sum(n for path, n in fleet.hub_stats()["served"].items() if path.startswith("org/c/"))
    return {
        "node": node, "killed_at_bytes": done, "ready_after_kill_seconds": time.monotonic() - killed,
        "message": ready[0]["message"], "hub_bytes": hub_bytes, "model_bytes": size,
    }  # fmt: skip


def cold_start(fleet: Fleet, profile: str) -> dict:
    """Model b wanted by two nodes, a streamed request at once: seconds to its first token and to both serving."""
    started = time.monotonic()
    fleet.apply(catalog({"b": profile}))
    body = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    first_token = None
    while first_token is None:
        with httpx.stream("POST", f"{fleet.router}/v1/chat/completions", json=body, timeout=3600,
                          headers={"Authorization": f"Bearer {fleet.key}"}) as response:  # fmt: skip
            if response.status_code == 404:  # the routers learn of the model a moment after the catalog is applied
                time.sleep(0.2)
                continue
            for line in response.iter_lines():
                if line.startswith("data: {") and '"content"' in line and first_token is None:
                    first_token = time.monotonic() - started
            if first_token is None:
                raise RuntimeError(f"no token from b: HTTP {response.status_code}")
    ready = wait_until(
        lambda: sum(1 for r in fleet.status()["replica_list"] if r["model"] == "b" and r["state"] == "ready") == 2,
        3600, 1.0, describe=fleet.log,
    )  # fmt: skip
    both = time.monotonic() - started if ready else None
    hub_bytes = sum(n for path, n in fleet.hub_stats()["served"].items() if path.startswith("org/b/"))
    return {"first_token_seconds": first_token, "both_ready_seconds": both, "hub_bytes": hub_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=2e9, help="bytes of each model (default 2e9)")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--hub-rate", type=float, default=50e6, help="the hub's bytes a second, all clients")
    parser.add_argument("--keep", default=None, help="keep the fleets' folders here (logs)")
    args = parser.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="staging-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    repos = work / "repos"
    size = int(args.size)
    results: dict = {"size_bytes": size, "hub_rate_MBps": args.hub_rate / 1e6}
    for name in ("a", "b", "c"):
        made = make_safetensors_repo(repos, f"org/{name}", size, files=args.files, seed=ord(name))
        size_on_disk = sum(p.stat().st_size for p in made.iterdir())
    results["model_bytes"] = size_on_disk
    results["loopback"] = loopback(repos / "org" / "a", work)
    # The tick and the heartbeats at their defaults, as deployed (the tests' fleets run them faster).
    fleet_env = {
        "LLMGW_ACTIVATION_TIMEOUT_SECONDS": "3600", "LLMGW_TICK_SECONDS": "2", "LLMGW_HEARTBEAT_SECONDS": "5",
        "LLMGW_STAGE_STALL_SECONDS": "10",  # the killed agent's stage is asked for again 10 s after its last report
    }  # fmt: skip
    print(json.dumps({"loopback": results["loopback"]}), flush=True)
    try:
        with staging_fleet(work / "staged", repos, NODES, hub_rate=args.hub_rate, env=fleet_env) as fleet:
            results["hub_once"] = hub_once(fleet, size_on_disk)
            print(json.dumps({"hub_once": results["hub_once"]}), flush=True)
            results["cold_start_staged"] = cold_start(fleet, PROFILE.format(min=2, extra=""))
            print(json.dumps({"cold_start_staged": results["cold_start_staged"]}), flush=True)
            results["resume"] = resume(fleet, size_on_disk)
            print(json.dumps({"resume": results["resume"]}), flush=True)
        baseline_env = {**fleet_env, "LLMGW_STAGE_ENGINES": ""}
        with staging_fleet(work / "downloads", repos, NODES, hub_rate=args.hub_rate, env=baseline_env) as fleet:
            download = PROFILE.format(min=2, extra=', engine_args: ["--download-weights", "org/b"]')
            results["cold_start_downloads"] = cold_start(fleet, download)
            print(json.dumps({"cold_start_downloads": results["cold_start_downloads"]}), flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    staged, downloads = results["cold_start_staged"], results["cold_start_downloads"]
    results["speedup_first_token"] = downloads["first_token_seconds"] / staged["first_token_seconds"]
    results["speedup_both_ready"] = downloads["both_ready_seconds"] / staged["both_ready_seconds"]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
