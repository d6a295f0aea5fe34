"""The mock engine's requests and counters: generation (chat, completions, streams), embeddings, and /metrics.

What it answers is described in mockengine/server.py, which serves it; when it may answer is the business of
mockengine/sleep.py (loading, asleep): each generation waits for that first, one run before a level-2 sleep's
weights were reloaded answers NO_WEIGHTS words, and one that a sleep catches in flight ends with finish reason
`abort`, as vLLM's sleep (mode abort) ends it.

By default an answer is "mock reply from <served>: <echo of the prompt>"; with `greedy` it is what greedy decoding
of a language model would give (mockengine/greedy.py), and a request may ask for vLLM's `return_token_ids`. The
shapes of those ids are vLLM 0.32.0's, as read in its installed source (vllm/entrypoints/openai/chat_completion/
protocol.py and serving.py, completion/protocol.py and serving.py; chunks dumped with exclude_unset):

* chat, streamed: `prompt_token_ids` at the top of the first chunk (the role's) only; each token chunk's choice
  has `token_ids` (its delta's ids);
* chat, whole: `prompt_token_ids` at the top, the choice's `token_ids` all of the answer's;
* completion, streamed: the first chunk's choice has `prompt_token_ids` (later ones `null`, as vLLM's explicit
  None serializes), each choice `token_ids`;
* completion, whole: the choice has both `prompt_token_ids` and `token_ids`.

vLLM puts the finish reason on the last token's chunk; the mock, in both modes, sends a finish chunk of its own
after the tokens, whose `token_ids` is then empty. With `exit_after_tokens` the process dies, as a crashed engine,
right after sending that many answer tokens in all (MockEngine._count_sent).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

from aiohttp import web

from mockengine.batch import MockBatch
from mockengine.greedy import (
    CONTEXT_TOKENS,
    DEFAULT_MAX_TOKENS,
    answer_ids,
    chat_context,
    next_words,
    prompt_ids,
    return_token_ids,
    token_id,
    token_texts,
)
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
# The `object` of an answer, by kind and whether it is streamed.
RESPONSE_OBJECTS = {
    ("chat", False): "chat.completion",
    ("chat", True): "chat.completion.chunk",
    ("completion", False): "text_completion",
    ("completion", True): "text_completion",
}


@dataclass(frozen=True)
class Answer:
    """One answer to give: each token's text as streamed, its finish reason, and its prompt as usage counts it
    and as the prefix cache sees it; in greedy mode also the ids, and whether the request wants them back."""

    texts: list[str]
    finish: str
    prompt_tokens: int
    cache_tokens: Sequence[Hashable]  # words, or token ids
    ids: list[int] | None = None
    prompt_ids: list[int] | None = None
    return_ids: bool = False

    def cut(self, produced: int) -> Answer:
        """The answer as far as it got when a sleep aborted it."""
        ids = None if self.ids is None else self.ids[:produced]
        return replace(self, texts=self.texts[:produced], finish="abort", ids=ids)

    def without_weights(self) -> Answer:
        """Every word NO_WEIGHTS, spaced as before: an answer computed before discarded weights were reloaded."""
        texts = [(" " if text.startswith(" ") else "") + NO_WEIGHTS for text in self.texts]
        ids = None if self.ids is None else [token_id(NO_WEIGHTS)] * len(self.ids)
        return replace(self, texts=texts, ids=ids)


def _stream_choice(kind: str, text: str, finish_reason: str | None = None, role: bool = False) -> dict:
    if kind == "chat":
        delta = {"role": "assistant", "content": text} if role else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def _with_stream_ids(kind: str, answer: Answer, choice: dict, index: int) -> dict:
    """`choice`, the chunk of token `index` (the finish chunk: index len(texts)), with the ids vLLM puts there
    when the request asked for them."""
    if answer.return_ids:
        if kind == "completion":
            choice["prompt_token_ids"] = answer.prompt_ids if index == 0 else None
        choice["token_ids"] = (answer.ids or [])[index : index + 1]
    return choice


class MockEngine:
    """Request handling and the counters behind /metrics for one served model.

    `greedy`: answer as greedy decoding would (mockengine/greedy.py). `exit_after_tokens`: die, as a crashed
    engine, once that many answer tokens were sent in all.
    """

    def __init__(
        self,
        model: str,
        token_delay_ms: float = 0.0,
        sleep: MockSleep | None = None,
        lora: MockLoRA | None = None,
        prefix_cache: MockPrefixCache | None = None,
        greedy: bool = False,
        exit_after_tokens: int | None = None,
        batch: MockBatch | None = None,
    ):
        self.model = model
        self.sleep = sleep or MockSleep()
        self.lora = lora or MockLoRA()
        self.prefix_cache = prefix_cache or MockPrefixCache()
        self.token_delay = token_delay_ms / 1000.0
        self.greedy = greedy
        self.exit_after_tokens = exit_after_tokens
        # Answer tokens sent over all answers, streamed or not: what --exit-after-tokens counts.
        self.tokens_sent = 0
        self.batch = batch or MockBatch()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_total = 0

    @property
    def running(self) -> int:
        """Requests in its batch now (mockengine/batch.py)."""
        return self.batch.running

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

    def _default_answer(self, body: dict, prompt_text: str, cache_tokens: list[str], prompt_tokens: int) -> Answer:
        """The default answer: "mock reply from <served>: <echo of the prompt>", a word a token."""
        max_tokens = self._max_tokens(body)
        # The model or a LoRA adapter: answers name it, as vLLM's do.
        tokens = self.reply_tokens(prompt_text, max_tokens, body["model"])
        finish = "length" if max_tokens is not None and len(tokens) == max_tokens else "stop"
        return Answer(token_texts(tokens, bare_first=True), finish, prompt_tokens, cache_tokens)

    def _greedy_answer(self, body: dict, context: list[int], bare_first: bool, chat: bool) -> Answer:
        """The answer greedy decoding gives after `context` (mockengine/greedy.py): always its limit long."""
        limit = self._max_tokens(body)
        if limit is None:
            named = "max_tokens" in body or "max_completion_tokens" in body
            # As vLLM: a chat, or a completion whose limit is an explicit null, runs to the end of the context.
            limit = CONTEXT_TOKENS - len(context) if chat or named else DEFAULT_MAX_TOKENS
            if limit < 1:
                raise BadRequest(
                    f"the prompt's {len(context)} tokens leave no room for an answer in the model's "
                    f"{CONTEXT_TOKENS}-token context",
                    "messages" if chat else "prompt",
                )
        produced = next_words(context, limit)
        return Answer(
            texts=token_texts(produced, bare_first),
            finish="length",
            prompt_tokens=len(context),
            cache_tokens=context,  # the prefix cache keys blocks by token: here an id is one
            ids=answer_ids(produced),
            prompt_ids=context,
            return_ids=return_token_ids(body),
        )

    async def _generate(self, request: web.Request, body: dict, kind: str, answer: Answer) -> web.StreamResponse:
        """Shared path of chat and text completions, streaming or not."""
        stream, include_usage = self._stream_flags(body)
        served = body["model"]
        head = {
            "id": ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24],
            "object": RESPONSE_OBJECTS[kind, stream],
            "created": int(time.time()),
            "model": served,
        }
        # Held, uncounted, while loading or asleep (mockengine/sleep.py).
        generation = await self.sleep.hold()
        if self.sleep.weights_discarded:
            answer = answer.without_weights()  # run before the reload a level-2 sleep needs (mockengine/sleep.py)
        priority = body.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise BadRequest("field “priority” must be an integer", "priority")
        await self.batch.enter(priority)  # may wait in the engine's own queue (mockengine/batch.py)
        self.prompt_tokens_total += answer.prompt_tokens
        # Requests per adapter, for vllm:lora_requests_info (the model itself is no adapter: adds 0).
        self.lora.running[served] += served != self.model
        try:
            await self.prefix_cache.prefill(answer.cache_tokens)
            if stream:
                return await self._stream(request, kind, head, answer, include_usage, generation)
            return await self._complete(kind, head, answer, generation)
        finally:
            self.batch.leave()
            self.lora.running[served] -= served != self.model
            self.requests_total += 1

    async def _complete(self, kind: str, head: dict, answer: Answer, generation: int) -> web.Response:
        """The whole answer in one response."""
        for produced in range(len(answer.texts)):
            if self.token_delay:
                await asyncio.sleep(self.batch.step(self.token_delay))
            if self.sleep.aborted(generation):
                answer = answer.cut(produced)
                break
            await self._count_sent(None)
        self.generation_tokens_total += len(answer.texts)
        text = "".join(answer.texts)
        choice: dict = {"index": 0, "text": text, "logprobs": None, "finish_reason": answer.finish}
        if kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": answer.finish,
            }
        payload = {**head, "choices": [choice], "usage": self._usage(answer.prompt_tokens, len(answer.texts))}
        if answer.return_ids:
            # As vLLM 0.32 answers: the prompt's ids at the top of a chat answer, in a completion's choice; the
            # choice's own ids in both (module docstring).
            (payload if kind == "chat" else choice)["prompt_token_ids"] = answer.prompt_ids
            choice["token_ids"] = answer.ids
        return web.json_response(payload)

    async def _stream(
        self, request: web.Request, kind: str, head: dict, answer: Answer, include_usage: bool, generation: int
    ) -> web.StreamResponse:
        """The answer as server-sent events: (chat: a role chunk), a chunk a token, a finish chunk, (usage)."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}
        )
        await response.prepare(request)

        async def send(choices: list, usage: dict | None = None, top: dict | None = None) -> None:
            chunk = {**head, "choices": choices}
            if include_usage:
                chunk["usage"] = usage
            chunk.update(top or {})
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        if kind == "chat":
            # vLLM sends a chat prompt's ids once, at the top of its first chunk: the role's.
            top = {"prompt_token_ids": answer.prompt_ids} if answer.return_ids else None
            await send([_stream_choice(kind, "", role=True)], top=top)
        if self.exit_after_tokens == 0:
            await self._exit(request)  # an engine that dies before its first token, its answer begun
        for i, text in enumerate(answer.texts):
            if self.token_delay:
                await asyncio.sleep(self.batch.step(self.token_delay))
            if self.sleep.aborted(generation):
                # Cut by a sleep: vLLM ends the stream, saying so in its finish reason.
                answer = answer.cut(i)
                break
            # Counted as produced, so /metrics moves while a stream is in flight.
            self.generation_tokens_total += 1
            await send([_with_stream_ids(kind, answer, _stream_choice(kind, text), i)])
            await self._count_sent(request)
        finish = _stream_choice(kind, "", finish_reason=answer.finish)
        await send([_with_stream_ids(kind, answer, finish, len(answer.texts))])
        if include_usage:
            await send([], usage=self._usage(answer.prompt_tokens, len(answer.texts)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _count_sent(self, request: web.Request | None) -> None:
        """Count one answer token sent; the one that reaches `--exit-after-tokens` ends the process at once, as
        an engine crashing mid-answer would: no finish chunk, no [DONE], its sockets closed by the kernel."""
        self.tokens_sent += 1
        if self.exit_after_tokens is None or self.tokens_sent < self.exit_after_tokens:
            return
        await self._exit(request)

    async def _exit(self, request: web.Request | None) -> None:
        """Die as a crashed engine: what this process still buffers is lost, what the kernel holds is sent."""
        transport = request.transport if request is not None else None
        # Only what is still in this process's buffer would be lost: the kernel delivers what it holds.
        for _ in range(100):
            if transport is None or not transport.get_write_buffer_size():
                break
            await asyncio.sleep(0.01)
        print(
            f"mock engine: exiting after {self.tokens_sent} tokens (--exit-after-tokens)", file=sys.stderr, flush=True
        )
        os._exit(1)

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
        if self.greedy:
            context, continued = chat_context(messages, body)
            answer = self._greedy_answer(body, context, bare_first=not continued, chat=True)
        else:
            answer = self._default_answer(body, last_user, prompt, len(prompt) - len(messages))
        return await self._generate(request, body, "chat", answer)

    async def completions(self, request: web.Request):
        body = await self._body(request)
        if (wrong := self._wrong_model(body)) is not None:
            return wrong
        prompt = body.get("prompt")
        # Greedy mode takes a prompt of token ids too, as vLLM does.
        ids = prompt_ids(prompt) if self.greedy else None
        if ids is not None:
            return await self._generate(request, body, "completion", self._greedy_answer(body, ids, False, chat=False))
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompt = " ".join(prompt)
        if not isinstance(prompt, str):
            raise BadRequest("field “prompt” must be a string or a list of strings", "prompt")
        tokens = words(prompt)
        if self.greedy:
            answer = self._greedy_answer(body, [token_id(token) for token in tokens], bare_first=False, chat=False)
        else:
            answer = self._default_answer(body, prompt, tokens, len(tokens))
        return await self._generate(request, body, "completion", answer)

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
        cache = min(1.0, self.batch.running / CACHE_SLOTS)
        rows = [
            ("vllm:num_requests_running", "gauge", "Number of requests currently running.", self.batch.running),
            ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", self.batch.waiting),
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
