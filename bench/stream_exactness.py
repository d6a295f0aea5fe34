"""How exactly a broken stream is continued on a real vLLM: each way of continuing against the uninterrupted answer.

    .venv/bin/python bench/stream_exactness.py [--streams 20] [--tokens 48] [--keep DIR]

One vLLM (the CPU build `make vllm` caches, on the suite's tiny random-weight Llama) serves a model that
router-only mode (`manage.py router --endpoints FILE`) knows by two endpoints: the engine behind a cutter (a
TCP relay that closes the connection after a given number of SSE events, as a dying engine's would be) with
the higher priority, so every stream begins there, and the engine itself. For each way of continuing
(`streams: token_ids`, then `streams: text`) a router serves `--streams` chat streams at temperature 0, each cut
after a different number of events, and each answer is compared byte for byte with the same request sent to
the engine directly. A random-weight model picks the end-of-sequence token at any step, so the requests ask
vLLM to ignore it (`ignore_eos`): every answer is `--tokens` long. The table: streams continued, answers
identical to the uninterrupted one (text, and token ids: the requests ask for them, and the router passes a
client's own on), and, for those that differ, where the text first diverges. A text continuation's token ids
cannot match: its engine counts what it re-read of the text as prompt, and gives ids only for the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from router_bench import free_port  # noqa: E402  (a sibling script, not a package)

from tests.e2e.engines.vllm_stack import tiny_model, vllm_install  # noqa: E402

MODEL = "tiny-vllm"
ENGINE_ARGS = ["--max-model-len", "4096", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.2"]
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
PROMPTS = ["tell me a story", "hello there", "what is the weather", "count to ten", "say something kind"]


class Cutter:
    """A TCP relay to `upstream` that closes a connection once the engine sent it the next cut's number of SSE
    events (`cuts`, taken in turn): the router then sees the engine break off, as when it dies."""

    def __init__(self, upstream: int, cuts: list[int]) -> None:
        self.upstream, self.cuts, self.port = upstream, cuts, free_port()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", self.port))
        self.loop.run_forever()

    async def _relay(self, client_reader, client_writer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        to_engine = asyncio.ensure_future(self._pump(client_reader, writer))
        cut, seen = None, 0
        try:
            while chunk := await reader.read(65536):
                seen += chunk.count(b"data: ")
                if cut is None and seen:
                    cut = self.cuts.pop(0) if self.cuts else 1 << 30  # a stream's answer began: its cut is set
                if cut is not None and seen >= cut:
                    # Up to the cut's event, then the connection drops mid-answer.
                    client_writer.write(chunk[: _nth(chunk, b"data: ", cut - (seen - chunk.count(b"data: ")))])
                    await client_writer.drain()
                    break
                client_writer.write(chunk)
                await client_writer.drain()
        finally:
            to_engine.cancel()
            for each in (writer, client_writer):
                each.transport.abort()

    @staticmethod
    async def _pump(reader, writer) -> None:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()


def _nth(data: bytes, needle: bytes, n: int) -> int:
    """Where the `n`-th occurrence of `needle` in `data` ends its event (the blank line after it), or the end."""
    at = -1
    for _ in range(n):
        at = data.find(needle, at + 1)
    end = data.find(b"\n\n", at)
    return len(data) if end < 0 else end + 2


def start_engine(model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    install = vllm_install()
    argv = [*install.command, "--model", str(model_dir), "--served-model-name", MODEL]
    argv += ["--host", "127.0.0.1", "--port", str(port), *ENGINE_ARGS]
    process = subprocess.Popen(argv, env={**os.environ, **ENGINE_ENV}, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert process.poll() is None, f"vLLM exited: see {log}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"vLLM did not start within 600 s: see {log}")


def start_router(workdir: Path, way: str, cutter: int, engine: int) -> tuple[subprocess.Popen, str, str]:
    """Router-only mode on the model's two endpoints, continuing `way`; (process, URL, a client key)."""
    env = {**os.environ, "LLMGW_HOME": str(workdir), "SECRET_KEY": "bench-only", "LOG_LEVEL": "WARNING"}
    env.pop("DATABASE_URL", None)
    env.pop("REDIS_URL", None)
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    key = subprocess.run(
        [*manage, "keys", "create", f"exactness-{way}"], cwd=ROOT, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()
    endpoints = workdir / "endpoints.yaml"
    rows = [{"url": f"http://127.0.0.1:{cutter}", "priority": 1}, f"http://127.0.0.1:{engine}"]
    endpoints.write_text(json.dumps({"models": {MODEL: {"endpoints": rows, "streams": way}}}))
    port = free_port()
    argv = [*manage, "router", "--port", str(port), "--endpoints", str(endpoints)]
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return process, url, key
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the router did not get ready")


def streamed_text(url: str, body: dict, key: str | None = None) -> tuple[str, list[int], list]:
    """(the answer's text, its token ids, the error events) of a chat stream."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text, ids, errors = [], [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"])
                for choice in event.get("choices", ()):
                    text.append(choice["delta"].get("content") or "")
                    ids += choice.get("token_ids") or ()
    return "".join(text), ids, errors


def measure(way: str, streams: int, tokens: int, engine: int, workdir: Path) -> dict:
    cuts = [3 + (i * 7) % (tokens - 6) for i in range(streams)]
    cutter = Cutter(engine, list(cuts))
    router, url, key = start_router(workdir / way, way, cutter.port, engine)
    identical, same_ids, diverged = 0, 0, []
    try:
        for i in range(streams):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} {i}"}]}
            body |= {"stream": True, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
            body["return_token_ids"] = True  # to compare the tokens too (the router passes the client's on)
            reference, reference_ids, _ = streamed_text(f"http://127.0.0.1:{engine}", body)
            continued, ids, errors = streamed_text(url, body, key)
            assert not errors, errors
            same_ids += ids == reference_ids
            if continued == reference:
                identical += 1
            else:
                at = next(n for n, (a, b) in enumerate(zip(continued + "\0", reference + "\0", strict=False)) if a != b)
                diverged.append(at)
                print(f"{way} stream {i} (cut after {cuts[i]} events) differs at {at}:", file=sys.stderr)
                print(f"  uninterrupted {reference[max(0, at - 20) : at + 20]!r}", file=sys.stderr)
                print(f"  continued     {continued[max(0, at - 20) : at + 20]!r}", file=sys.stderr)
    finally:
        router.terminate()
        router.wait(10)
    return {"way": way, "streams": streams, "identical": identical, "same_ids": same_ids, "diverged_at": diverged}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--keep", help="keep the work folder (vLLM's log, the routers' databases) here")
    parser.add_argument("--engine-port", type=int, help="use the vLLM already serving the tiny model on this port")
    args = parser.parse_args()
    workdir = Path(args.keep or tempfile.mkdtemp(prefix="llmgw-exactness-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = tiny_model(vllm_install()) / "model"
    port = args.engine_port or free_port()
    engine = None if args.engine_port else start_engine(model_dir, port, workdir / "vllm.log")
    try:
        rows = [measure(way, args.streams, args.tokens, port, workdir) for way in ("token_ids", "text")]
    finally:
        if engine is not None:
            engine.terminate()
            engine.wait(30)
    print("| continued by | streams | text identical | token ids identical | where the text differs (character) |")
    print("|---|---:|---:|---:|---|")
    for row in rows:
        where = ", ".join(map(str, row["diverged_at"])) or "-"
        n = row["streams"]
        print(f"| {row['way']} | {n} | {row['identical']} / {n} | {row['same_ids']} / {n} | {where} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
