"""The bundled mock engine: a tiny OpenAI-compatible server for demos and tests.

    python -m agent.mock_engine --port 20001 --model demo-small [--host 127.0.0.1] [--token-delay-ms 20]
        [--memory-gib-per-gpu 30]

It answers chat completions, completions (plain and SSE streaming, with usage),
embeddings and the model list (and acknowledges vLLM's other JSON endpoints,
EXTRA_ENDPOINTS, so a router's proxying of them can be tested), and exposes `/health` and a vLLM-style
`/metrics` (the gauge names and labels of vLLM 0.32.0, checked against the real server in
tests/test_e2e_vllm.py), so the router's balancing and usage accounting work against it as
they would against vLLM. Replies are deterministic and name the model that
answered; a token is a word.

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
port rule, and the name of the agent's GPU memory variable): the agent starts
one per simulated shard and the demo must be ready within a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import uuid

from aiohttp import web

from .engine_env import GPU_MEMORY_ENV
from .mock_text import BadRequest, content_text, embedding_vector, openai_error, words
from .protocol import parse_port

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


EMBEDDING_DIMENSIONS = 16
# Simulated KV-cache slots, so kv_cache_usage_perc moves with the running requests.
CACHE_SLOTS = 32
ECHO_WORDS = 12
# Other JSON endpoints of vLLM and OpenAI that name a model: answered with a receipt naming the path.
EXTRA_ENDPOINTS = ("/v1/responses", "/v1/rerank", "/rerank", "/v1/score", "/score", "/tokenize", "/detokenize")


class MockEngine:
    """Request handling and the counters behind /metrics for one served model."""

    def __init__(self, model: str, token_delay_ms: float = 0.0):
        self.model = model
        self.token_delay = token_delay_ms / 1000.0
        self.running = 0
        self.waiting = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_total = 0

    # -- helpers ----------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("field “model” is required and must be a string", "model")
        return body

    def _wrong_model(self, body: dict):
        if body["model"] != self.model:
            return openai_error(
                404,
                f"The model `{body['model']}` does not exist (this engine serves `{self.model}`).",
                param="model",
                code="model_not_found",
            )
        return None

    @staticmethod
    def _max_tokens(body: dict) -> int | None:
        value = body.get("max_completion_tokens", body.get("max_tokens"))
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest("max_tokens must be a positive integer", "max_tokens")
        return value

    @staticmethod
    def _stream_flags(body: dict) -> tuple[bool, bool]:
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("field “stream” must be a boolean", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise BadRequest("field “stream_options” must be an object", "stream_options")
        return stream, bool(options.get("include_usage", False))

    def reply_tokens(self, prompt: str, max_tokens: int | None) -> list[str]:
        echo = words(prompt)[:ECHO_WORDS]
        tokens = ["mock", "reply", "from", f"{self.model}:", *(echo or ["(empty)"])]
        return tokens[:max_tokens] if max_tokens else tokens

    def _usage(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    async def _generate(self, request, body, kind: str, prompt_text: str, prompt_tokens: int):
        """Shared path of chat and text completions, streaming or not."""
        stream, include_usage = self._stream_flags(body)
        max_tokens = self._max_tokens(body)
        tokens = self.reply_tokens(prompt_text, max_tokens)
        finish = "length" if max_tokens is not None and len(tokens) == max_tokens else "stop"
        ident = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        self.prompt_tokens_total += prompt_tokens
        self.running += 1
        try:
            if not stream:
                if self.token_delay:
                    await asyncio.sleep(self.token_delay * len(tokens))
                self.generation_tokens_total += len(tokens)
                text = " ".join(tokens)
                if kind == "chat":
                    choice = {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                    obj = "chat.completion"
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
                    obj = "text_completion"
                return web.json_response(
                    {
                        "id": ident,
                        "object": obj,
                        "created": created,
                        "model": self.model,
                        "choices": [choice],
                        "usage": self._usage(prompt_tokens, len(tokens)),
                    }
                )
            return await self._stream(request, kind, ident, created, tokens, finish, prompt_tokens, include_usage)
        finally:
            self.running -= 1
            self.requests_total += 1

    async def _stream(self, request, kind, ident, created, tokens, finish, prompt_tokens, include_usage):
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}
        )
        await response.prepare(request)
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        async def send(choices: list, usage=None):
            chunk = {"id": ident, "object": obj, "created": created, "model": self.model, "choices": choices}
            if include_usage:
                chunk["usage"] = usage
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        def choice(text: str, finish_reason=None, role: bool = False):
            if kind == "chat":
                delta = {"role": "assistant", "content": text} if role else {"content": text}
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

        if kind == "chat":
            await send([choice("", role=True)])
        for i, token in enumerate(tokens):
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            # Counted as produced, so /metrics moves while a stream is in flight.
            self.generation_tokens_total += 1
            await send([choice(token if i == 0 else " " + token)])
        await send([choice("", finish_reason=finish)])
        if include_usage:
            await send([], usage=self._usage(prompt_tokens, len(tokens)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # -- routes -------------------------------------------------------------------
    async def chat_completions(self, request: web.Request):
        body = await self._body(request)
        if (wrong := self._wrong_model(body)) is not None:
            return wrong
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("field “messages” must be a non-empty list", "messages")
        texts, last_user = [], ""
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequest("each message must be an object with a string “role”", "messages")
            text = content_text(message.get("content"))
            texts.append(text)
            if message["role"] == "user":
                last_user = text
        prompt_tokens = sum(len(words(t)) for t in texts)
        return await self._generate(request, body, "chat", last_user, prompt_tokens)

    async def completions(self, request: web.Request):
        body = await self._body(request)
        if (wrong := self._wrong_model(body)) is not None:
            return wrong
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompt = " ".join(prompt)
        if not isinstance(prompt, str):
            raise BadRequest("field “prompt” must be a string or a list of strings", "prompt")
        return await self._generate(request, body, "completion", prompt, len(words(prompt)))

    async def embeddings(self, request: web.Request):
        body = await self._body(request)
        if (wrong := self._wrong_model(body)) is not None:
            return wrong
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs or not all(isinstance(i, str) for i in inputs):
            raise BadRequest("field “input” must be a string or a non-empty list of strings", "input")
        dimensions = body.get("dimensions", EMBEDDING_DIMENSIONS)
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= 4096:
            raise BadRequest("field “dimensions” must be an integer from 1 to 4096", "dimensions")
        prompt_tokens = sum(len(words(i)) for i in inputs)
        self.requests_total += 1
        self.prompt_tokens_total += prompt_tokens
        data = [
            {"object": "embedding", "index": i, "embedding": embedding_vector(text, dimensions)}
            for i, text in enumerate(inputs)
        ]
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "model": self.model,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            }
        )

    async def extra_endpoint(self, request: web.Request):
        body = await self._body(request)
        if (wrong := self._wrong_model(body)) is not None:
            return wrong
        self.requests_total += 1
        return web.json_response({"object": "mock.receipt", "model": self.model, "path": request.path})

    async def models(self, request: web.Request):
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "llmgw-mock"}],
            }
        )

    async def health(self, request: web.Request):
        hold = os.environ.get(HOLD_FILE_ENV)
        if hold and os.path.exists(hold):
            return web.Response(status=503, text=f"held back while {hold} exists\n")
        return web.Response(text="ok\n")

    async def metrics(self, request: web.Request):
        return web.Response(text=self.render_metrics(), content_type="text/plain", charset="utf-8")

    def render_metrics(self) -> str:
        """Prometheus text exposition with vLLM's metric names."""
        escaped = self.model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        label = f'{{engine="0",model_name="{escaped}"}}'
        cache = min(1.0, self.running / CACHE_SLOTS)
        rows = [
            ("vllm:num_requests_running", "gauge", "Number of requests currently running.", self.running),
            ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", self.waiting),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", cache),
            ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", self.prompt_tokens_total),
            ("vllm:generation_tokens_total", "counter", "Number of generation tokens.", self.generation_tokens_total),
            ("vllm:request_success_total", "counter", "Number of finished requests.", self.requests_total),
        ]
        lines = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{label} {float(value)}"]
        return "\n".join(lines) + "\n"


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


def create_app(model: str, token_delay_ms: float = 0.0) -> web.Application:
    """The aiohttp application serving `model`."""
    engine = MockEngine(model, token_delay_ms)
    app = web.Application(middlewares=[errors_in_openai_shape])
    app["engine"] = engine
    app.router.add_post("/v1/chat/completions", engine.chat_completions)
    app.router.add_post("/v1/completions", engine.completions)
    app.router.add_post("/v1/embeddings", engine.embeddings)
    for path in EXTRA_ENDPOINTS:
        app.router.add_post(path, engine.extra_endpoint)
    app.router.add_get("/v1/models", engine.models)
    app.router.add_get("/health", engine.health)
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


def _model(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("model name must not be empty")
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m agent.mock_engine", description="llmgw's bundled mock engine.")
    parser.add_argument("--port", type=_port, required=True, help="TCP port to listen on")
    parser.add_argument("--model", type=_model, required=True, help="the model name this engine serves")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--token-delay-ms", type=_delay, default=0.0, help="wait this long per token (default 0)")
    parser.add_argument(
        "--memory-gib-per-gpu",
        type=_memory,
        default=None,
        help=f"the engine's true need per GPU: fail the start like CUDA out of memory when its GPUs ({GPU_MEMORY_ENV}) "
        "have less usable",
    )
    return parser.parse_args(argv)


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
    app = create_app(args.model, args.token_delay_ms)
    print(f"mock engine serving {args.model} on {args.host}:{args.port}", flush=True)
    try:
        # run_app turns SIGINT and SIGTERM into a graceful exit.
        web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=2.0)
    except OSError as exc:
        print(f"mock engine cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print("mock engine stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
