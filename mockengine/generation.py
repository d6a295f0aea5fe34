"""The mock engine's requests and counters: generation (chat, completions, streams), embeddings, and /metrics.

What it answers is described in mockengine/server.py, which serves it; when it may answer is the business of
mockengine/sleep.py (loading, asleep): each generation waits for that first, one run before a level-2 sleep's
weights were reloaded answers NO_WEIGHTS words, and one that a sleep catches in flight ends with finish reason
`abort`, as vLLM's sleep (mode abort) ends it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from aiohttp import web

from mockengine.lora import MockLoRA
from mockengine.prefix_cache import MockPrefixCache
from mockengine.sleep import NO_WEIGHTS, MockSleep
from mockengine.text import BadRequest, content_text, embedding_vector, openai_error, words

EMBEDDING_DIMENSIONS = 16
# Simulated KV-cache slots, so kv_cache_usage_perc moves with the running requests.
CACHE_SLOTS = 32
ECHO_WORDS = 12
# Other JSON endpoints of vLLM and OpenAI that name a model: answered with a receipt naming the path.
EXTRA_ENDPOINTS = ("/v1/responses", "/v1/rerank", "/rerank", "/v1/score", "/score", "/tokenize", "/detokenize")


class MockEngine:
    """Request handling and the counters behind /metrics for one served model."""

    def __init__(
        self,
        model: str,
        token_delay_ms: float = 0.0,
        sleep: MockSleep | None = None,
        lora: MockLoRA | None = None,
        prefix_cache: MockPrefixCache | None = None,
    ):
        self.model = model
        self.sleep = sleep or MockSleep()
        self.lora = lora or MockLoRA()
        self.prefix_cache = prefix_cache or MockPrefixCache()
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
        """A 404 for a model this engine does not serve: neither its own nor a LoRA adapter it holds."""
        if body["model"] != self.model and body["model"] not in self.lora.held:
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

    def reply_tokens(self, prompt: str, max_tokens: int | None, served: str | None = None) -> list[str]:
        """The reply's words; `served` names what answers (an adapter, or by default the model)."""
        echo = words(prompt)[:ECHO_WORDS]
        tokens = ["mock", "reply", "from", f"{served or self.model}:", *(echo or ["(empty)"])]
        return tokens[:max_tokens] if max_tokens else tokens

    def _usage(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    async def _generate(self, request, body, kind: str, prompt_text: str, prompt: list[str], prompt_tokens: int):
        """Shared path of chat and text completions, streaming or not; `prompt`: its tokens as the prefix cache
        sees them, `prompt_tokens` as its usage counts them."""
        stream, include_usage = self._stream_flags(body)
        max_tokens = self._max_tokens(body)
        # The model or a LoRA adapter: answers name it, as vLLM's do.
        served = body["model"]
        tokens = self.reply_tokens(prompt_text, max_tokens, served)
        finish = "length" if max_tokens is not None and len(tokens) == max_tokens else "stop"
        ident = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        # Held, uncounted, while loading or asleep (mockengine/sleep.py).
        generation = await self.sleep.hold()
        if self.sleep.weights_discarded:
            tokens = [NO_WEIGHTS] * len(tokens)  # run before the reload a level-2 sleep needs (mock_sleep.py)
        self.prompt_tokens_total += prompt_tokens
        self.running += 1
        # Requests per adapter, for vllm:lora_requests_info (the model itself is no adapter: adds 0).
        self.lora.running[served] += served != self.model
        try:
            await self.prefix_cache.prefill(prompt)
            if not stream:
                for produced in range(len(tokens)):
                    if self.token_delay:
                        await asyncio.sleep(self.token_delay)
                    if self.sleep.aborted(generation):
                        tokens, finish = tokens[:produced], "abort"
                        break
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
                        "model": served,
                        "choices": [choice],
                        "usage": self._usage(prompt_tokens, len(tokens)),
                    }
                )
            answer = (kind, ident, created, tokens, finish, prompt_tokens, include_usage, generation)
            return await self._stream(request, served, *answer)
        finally:
            self.running -= 1
            self.lora.running[served] -= served != self.model
            self.requests_total += 1

    async def _stream(
        self, request, served, kind, ident, created, tokens, finish, prompt_tokens, include_usage, generation
    ):
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}
        )
        await response.prepare(request)
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        async def send(choices: list, usage=None):
            chunk = {"id": ident, "object": obj, "created": created, "model": served, "choices": choices}
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
            if self.sleep.aborted(generation):
                # Cut by a sleep: vLLM ends the stream, saying so in its finish reason.
                tokens, finish = tokens[:i], "abort"
                break
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
        prompt, last_user = [], ""
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequest("each message must be an object with a string “role”", "messages")
            text = content_text(message.get("content"))
            # The role as a token of the prefix cache's (as a chat template marks it), not counted in usage.
            prompt += [f"<{message['role']}>", *words(text)]
            if message["role"] == "user":
                last_user = text
        return await self._generate(request, body, "chat", last_user, prompt, len(prompt) - len(messages))

    async def completions(self, request: web.Request):
        body = await self._body(request)
        if (wrong := self._wrong_model(body)) is not None:
            return wrong
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompt = " ".join(prompt)
        if not isinstance(prompt, str):
            raise BadRequest("field “prompt” must be a string or a list of strings", "prompt")
        tokens = words(prompt)
        return await self._generate(request, body, "completion", prompt, tokens, len(tokens))

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
        await self.sleep.hold()
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
                "model": body["model"],
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            }
        )

    async def extra_endpoint(self, request: web.Request):
        body = await self._body(request)
        if (wrong := self._wrong_model(body)) is not None:
            return wrong
        self.requests_total += 1
        return web.json_response({"object": "mock.receipt", "model": body["model"], "path": request.path})

    async def models(self, request: web.Request):
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": self.model, "object": "model", "created": 0, "owned_by": "llmgw-mock"},
                    *self.lora.model_cards(self.model),
                ],
            }
        )

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
        lines += self.sleep.metric_lines(label)
        lines += self.prefix_cache.metric_lines(label)
        lines += self.lora.metric_lines()
        return "\n".join(lines) + "\n"
