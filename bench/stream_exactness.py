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
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e.engines.cutter import Cutter, free_port, start_router, streamed_text  # noqa: E402
from tests.e2e.engines.vllm_stack import tiny_model, vllm_install  # noqa: E402

MODEL = "tiny-vllm"
ENGINE_ARGS = ["--max-model-len", "4096", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.2"]
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
PROMPTS = ["tell me a story", "hello there", "what is the weather", "count to ten", "say something kind"]


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


def measure(way: str, streams: int, tokens: int, engine: int, workdir: Path) -> dict:
    cuts = [3 + (i * 7) % (tokens - 6) for i in range(streams)]
    cutter = Cutter(engine, list(cuts))
    router, url, key = start_router(workdir / way, MODEL, way, cutter.port, engine)
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
