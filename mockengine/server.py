"""The bundled mock engine: a tiny OpenAI-compatible server for demos and tests.

    python -m mockengine --port 20001 --model demo-small [--host 127.0.0.1] [--token-delay-ms 20]
        [--memory-gib-per-gpu 30] [--load-seconds 20] [--wake-seconds 1]
        [--enable-lora [--max-loras 8] [--max-lora-rank 16] [--lora-load-seconds 2]] [--api-key KEY]
        [--greedy] [--exit-after-tokens N]

It answers chat completions, completions (plain and SSE streaming, with usage),
embeddings and the model list (and acknowledges vLLM's other JSON endpoints,
EXTRA_ENDPOINTS, so a router's proxying of them can be tested), and exposes `/health` and a vLLM-style
`/metrics` (the gauge names and labels of vLLM 0.32.0, checked against the real server in
tests/e2e/engines/test_vllm.py), so the router's balancing and usage accounting work against it as
they would against vLLM. Replies are deterministic and name the model that
answered; a token is a word.

With `--greedy` it answers instead as greedy decoding of a real language model would (mockengine/greedy.py):
`max_tokens` pseudo-words (16 without it) that depend only on the context, so a request continuing a context with
part of an answer (prompt token ids, or a chat's `continue_final_message`) gets exactly the rest of it; it then
honours vLLM's `return_token_ids`. `--exit-after-tokens N` makes it die as a crashed engine would (exit 1 at once,
no finish chunk nor [DONE]) right after sending its N-th answer token, counted over all its answers (0: as soon as
its first stream has begun, before any token): what a router's stream continuation is tested against.

It models what a CPU cannot show of vLLM (mockengine/sleep.py): a cold start (`--load-seconds`), and,
with VLLM_SERVER_DEV_MODE=1 as vLLM, its sleep routes, the held requests of a sleeping engine, a wake whole
or by memory pool, the weights a level-2 sleep discards, the `vllm:engine_sleep_state` gauge and a wake that
takes `--wake-seconds`. With `--enable-lora` and
VLLM_ALLOW_RUNTIME_LORA_UPDATING as vLLM, it loads and serves LoRA adapters (mockengine/lora.py). Requests and
counters are mockengine/generation.py's.

A node's engines can be held back, as a slow engine start would be: while the
file named by LLMGW_MOCK_HOLD_FILE (in the environment the agent passes on)
exists, `/health` answers 503, so drills and tests can keep one shard of a
multi-node replica starting.

Told its true need (`--memory-gib-per-gpu X`), it checks it against the memory
of the GPUs the agent placed it on (GPU_MEMORY_ENV, MiB per GPU, set by the
agent like CUDA_VISIBLE_DEVICES) with vLLM's default share of each GPU, and
fails its start as an engine out of memory would: exit 1 with a CUDA
out-of-memory last line (`out_of_memory`, the rule the placement drill checks).

This module imports nothing from Django (only the agent's protocol, for the
port rule, and the names of the variables the agent sets): the agent starts
one per simulated shard and the demo must be ready within a second.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from aiohttp import web
from huggingface_hub import snapshot_download

from mockengine.batch import MockBatch
from mockengine.generation import EXTRA_ENDPOINTS, MockEngine
from mockengine.lora import MockLoRA, runtime_updates_allowed
from mockengine.prefix_cache import MockPrefixCache
from mockengine.sleep import MockSleep
from mockengine.text import ENGINE, BadRequest, openai_error
from nodewire.engine_env import GPU_MEMORY_ENV, VLLM_DEV_MODE_ENV
from nodewire.protocol import parse_port

__all__ = ["create_app", "main", "out_of_memory"]

HOLD_FILE_ENV = "LLMGW_MOCK_HOLD_FILE"
# The share of each GPU the mock may use, vLLM's default gpu_memory_utilization (catalog/memory.py judges
# the mock as vLLM).
MOCK_MEMORY_FRACTION = 0.92


def out_of_memory(need_gib: float, gpu_memory_mib: list[int], fraction: float = MOCK_MEMORY_FRACTION) -> str | None:
    """The CUDA out-of-memory line an engine needing `need_gib` GiB per GPU prints on these GPUs, or None if it
    fits on every one (usable = total × `fraction`)."""
    for index, mib in enumerate(gpu_memory_mib):
        total = mib / 1024
        usable = total * fraction
        if need_gib > usable:
            return (
                f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {need_gib - usable:.2f} GiB. "
                f"GPU {index} has a total capacity of {total:.2f} GiB, of which {usable:.2f} GiB may be used "
                f"(gpu_memory_utilization {fraction}); this engine needs {need_gib:.2f} GiB per GPU"
            )
    return None


def gpu_memory_from_env(value: str | None) -> list[int] | None:
    """The agent's GPU_MEMORY_ENV value as MiB per GPU; None when absent (memory unknown: no check)."""
    if not value:
        return None
    try:
        return [int(part) for part in value.split(",")]
    except ValueError:
        raise ValueError(f"{GPU_MEMORY_ENV} must be MiB per GPU separated by commas, got {value!r}") from None


async def health(request: web.Request):
    hold = os.environ.get(HOLD_FILE_ENV)
    if hold and os.path.exists(hold):
        return web.Response(status=503, text=f"held back while {hold} exists\n")
    if not request.app[ENGINE].sleep.loaded:
        return web.Response(status=503, text="loading\n")
    return web.Response(text="ok\n")


# vLLM 0.32's AuthenticationMiddleware guards these path prefixes only (/health and /metrics stay open).
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


def bearer_guard(api_key: str):  # aiohttp's middleware type is private: left unannotated
    """vLLM's `--api-key`: a guarded path without `Authorization: Bearer <key>` answers 401 `{"error": "Unauthorized"}`."""

    @web.middleware
    async def guard(request: web.Request, handler):
        if request.method != "OPTIONS" and request.path.startswith(GUARDED_PREFIXES):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or token != api_key:
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return guard


@web.middleware
async def errors_in_openai_shape(request: web.Request, handler):
    """Bad input and unknown routes answer in OpenAI's error shape, as the real engines do."""
    try:
        return await handler(request)
    except BadRequest as exc:
        return openai_error(400, str(exc), param=exc.param)
    except web.HTTPNotFound:
        return openai_error(404, f"no route for {request.method} {request.path}", code="not_found")
    except web.HTTPMethodNotAllowed:
        return openai_error(405, f"method {request.method} is not allowed on {request.path}")


def create_app(
    model: str,
    token_delay_ms: float = 0.0,
    load_seconds: float = 0.0,
    wake_seconds: float = 0.0,
    dev_mode: bool = False,
    lora: MockLoRA | None = None,
    runtime_lora: bool = False,
    prefix_cache: MockPrefixCache | None = None,
    api_key: str | None = None,
    greedy: bool = False,
    exit_after_tokens: int | None = None,
    batch: MockBatch | None = None,
) -> web.Application:
    """The aiohttp application serving `model`; `dev_mode` adds vLLM's sleep routes (mockengine/sleep.py).

    `lora` holds its LoRA adapters (mockengine/lora.py); `runtime_lora` adds vLLM's routes that load and
    unload them. `api_key`: as vLLM's `--api-key`, its API routes want it as a bearer token. `greedy` and
    `exit_after_tokens`: `--greedy` and `--exit-after-tokens` (module docstring). `batch`: how many requests run at
    once, the rest waiting (mockengine/batch.py); default: all at once.
    """
    sleep = MockSleep(load_seconds, wake_seconds)
    lora = lora or MockLoRA()
    engine = MockEngine(model, token_delay_ms, sleep, lora, prefix_cache, greedy, exit_after_tokens, batch)
    app = web.Application(middlewares=[errors_in_openai_shape] + ([bearer_guard(api_key)] if api_key else []))
    app[ENGINE] = engine
    if runtime_lora:
        lora.add_routes(app)
    app.on_startup.append(sleep.load)
    if dev_mode:
        sleep.add_routes(app)
        sleep.on_reset_prefix_cache = engine.prefix_cache.reset
    app.router.add_post("/v1/chat/completions", engine.chat_completions)
    app.router.add_post("/v1/completions", engine.completions)
    app.router.add_post("/v1/embeddings", engine.embeddings)
    for path in EXTRA_ENDPOINTS:
        app.router.add_post(path, engine.extra_endpoint)
    app.router.add_get("/v1/models", engine.models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", engine.metrics)
    return app


def _port(text: str) -> int:
    try:
        return parse_port(text)
    except ValueError as exc:
        # argparse shows the text of an ArgumentTypeError only; a ValueError would become "invalid value".
        raise argparse.ArgumentTypeError(str(exc)) from None


def _delay(text: str) -> float:
    try:
        delay = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"token delay must be a number of milliseconds, got {text!r}") from None
    if not 0 <= delay <= 60_000 or math.isnan(delay):
        raise argparse.ArgumentTypeError(f"token delay must be from 0 to 60000 ms, got {text}")
    return delay


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a time must be a number of seconds, got {text!r}") from None
    if not 0 <= seconds <= 3600 or math.isnan(seconds):
        raise argparse.ArgumentTypeError(f"a time must be from 0 to 3600 seconds, got {text}")
    return seconds


def _model(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("model name must not be empty")
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mockengine", description="llmgw's bundled mock engine.")
    parser.add_argument("--port", type=_port, required=True, help="TCP port to listen on")
    parser.add_argument("--model", type=_model, required=True, help="the model name this engine serves")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--token-delay-ms", type=_delay, default=0.0, help="wait this long per token (default 0)")
    parser.add_argument(
        "--load-seconds", type=_seconds, default=0.0, help="from launch until /health answers 200, as a cold start"
    )
    parser.add_argument("--wake-seconds", type=_seconds, default=0.0, help="how long POST /wake_up takes")
    parser.add_argument(
        "--memory-gib-per-gpu",
        type=_memory,
        default=None,
        help=f"the engine's true need per GPU: fail the start like CUDA out of memory when its GPUs ({GPU_MEMORY_ENV}) "
        "have less usable",
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("VLLM_API_KEY") or None, help="want this bearer key, as vLLM's --api-key"
    )
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters, as vLLM's")
    parser.add_argument("--max-loras", type=_slots, default=None, help="LoRA adapters held at once (default 1)")
    parser.add_argument("--max-lora-rank", type=_slots, default=None, help="the largest LoRA rank (default 16)")
    parser.add_argument(
        "--lora-load-seconds", type=_seconds, default=0.0, help="how long POST /v1/load_lora_adapter takes"
    )
    parser.add_argument(
        "--prefix-cache-tokens", type=_count, default=0, help="prompt tokens its prefix cache holds (default 0: none)"
    )
    parser.add_argument(
        "--uncached-token-ms", type=_delay, default=0.0, help="time to first token per prompt token not cached"
    )
    parser.add_argument(
        "--max-num-seqs", type=_slots, default=None, help="requests run at once, the rest wait (default: no bound)"
    )
    parser.add_argument(
        "--batch-slowdown",
        type=_slowdown,
        default=0.0,
        help="each token takes the token delay × (1 + this × the other requests running), as a GPU's decode step "
        "grows with its batch (default 0: no slower)",
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="the order waiting requests run in: first come, first served, or by their `priority` field (as vLLM)",
    )
    parser.add_argument(
        "--download-weights",
        default=None,
        metavar="REPO_ID",
        help="before serving, download this hub repository into HF_HOME with the hub's own client, as vLLM does "
        "with a hub id its node lacks (HF_ENDPOINT, HF_TOKEN apply); for comparing with staged weights",
    )
    _add_continuation_arguments(parser)
    return parser.parse_args(argv)


def _add_continuation_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that test a router's stream continuation: answers that can be continued, and a crash."""
    parser.add_argument(
        "--greedy", action="store_true", help="answer as greedy decoding of a language model (mockengine/greedy.py)"
    )
    parser.add_argument(
        "--exit-after-tokens",
        type=_whole_number(0),
        default=None,
        metavar="N",
        help="die as a crashed engine (exit 1) right after sending the N-th answer token, over all answers "
        "(0: once a stream has begun, before its first token)",
    )


def _whole_number(minimum: int):
    """An argparse type: a whole number of at least `minimum`."""
    wanted = "a positive integer" if minimum == 1 else f"a whole number of {minimum} or more"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text}")
        return value

    return parse


_count, _slots = _whole_number(0), _whole_number(1)


def _slowdown(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the batch slowdown must be a number, got {text!r}") from None
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"the batch slowdown must be from 0 to 100, got {text}")
    return value


def _memory(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"memory per GPU must be a number of GiB, got {text!r}") from None
    if not 0 < value <= 4096 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"memory per GPU must be from 0 to 4096 GiB, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_gib_per_gpu is not None:
        try:
            gpus = gpu_memory_from_env(os.environ.get(GPU_MEMORY_ENV))
        except ValueError as exc:
            print(f"mock engine: {exc}", file=sys.stderr)
            return 2
        oom = None if gpus is None else out_of_memory(args.memory_gib_per_gpu, gpus)
        if oom is not None:
            print(f"mock engine loading {args.model}: {args.memory_gib_per_gpu:g} GiB per GPU", flush=True)
            print(oom, file=sys.stderr, flush=True)
            return 1
    if args.download_weights:
        started = time.monotonic()
        print(f"mock engine downloading {args.download_weights}", flush=True)
        snapshot_download(args.download_weights)  # holds its GPUs all along, as an engine's own download does
        print(f"downloaded {args.download_weights} in {time.monotonic() - started:.1f} s", flush=True)
    # As vLLM does, the sleep routes are served only in its development mode.
    dev_mode = os.environ.get(VLLM_DEV_MODE_ENV, "") not in ("", "0")
    lora = MockLoRA(args.enable_lora, args.max_loras, args.max_lora_rank, args.lora_load_seconds)
    # As vLLM does, the adapter routes are served only when runtime updates are allowed.
    cache = MockPrefixCache(args.prefix_cache_tokens, args.uncached_token_ms)
    app = create_app(
        args.model,
        args.token_delay_ms,
        args.load_seconds,
        args.wake_seconds,
        dev_mode,
        lora,
        runtime_updates_allowed(),
        cache,
        args.api_key,
        args.greedy,
        args.exit_after_tokens,
        MockBatch(args.max_num_seqs, args.scheduling_policy == "priority", args.batch_slowdown),
    )
    print(f"mock engine serving {args.model} on {args.host}:{args.port}", flush=True)
    try:
        # run_app turns SIGINT and SIGTERM into a graceful exit.
        # uvicorn's backlog, as vLLM's server has: the streams a dead replica held arrive at once, and aiohttp's
        # default of 128 pending connections drops the rest, whose clients try again a second later.
        web.run_app(
            app, host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=2.0, backlog=2048
        )
    except OSError as exc:
        print(f"mock engine cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print("mock engine stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
