"""Continuing a stream whose engine broke off: the rest of the answer comes from another replica, in the same stream.

A chat or text completion streamed through the router (CONTINUABLE_PATHS) keeps
a transcript: the bytes of every whole event relayed to the client (one list
append per chunk; nothing is parsed while the answer flows). When the engine
breaks off after the answer began (a reset or closed connection, silence past
the next-chunk deadline, or an end it made itself unfinished: an error event,
or `finish_reason` "abort" as vLLM ends the requests a forced sleep cuts), the
transcript is read once and the request is sent to another ready replica of
the same model, asking only for the rest:

* **token-exact** where the first replica gave token ids (vLLM's
  `return_token_ids`, which the router asks for where the model's engines
  accept it): a text completion whose prompt is the original prompt's token
  ids and the generated ones. The engine resumes from exactly the state it
  would have reached: at temperature 0 the rest is the same tokens.
* **text** otherwise: a chat completion with the text so far as a final
  assistant message (`continue_final_message`), or a completion whose prompt
  is the prompt and the text so far. A tokenizer may split the text
  differently from how it was generated, so the rest may differ slightly.

Either way the request keeps its sampling settings and stop conditions, with
`max_tokens` less what was produced. The continuation's events are rewritten
before they reach the client: its id, `created` and model as the
first replica's, no second role delta, token ids only if the client asked, and
one usage chunk counting the client's prompt once and every leg's completion
tokens (router.forwarding.transcript).

Continuing would change the answer where the engine constrained it or the
client reads more than text: `n` > 1, guided decoding (`response_format` with
a schema, vLLM's structured outputs), `logprobs`, an echoed prompt, a tool call
or reasoning already begun. Such a stream ends as before: an error event,
counted with the refusal's name as its outcome.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from router.errors import EngineEndedUnfinished

CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
COMPLETION_PATH = "/v1/completions"
CONTINUABLE_PATHS = CHAT_PATHS | {COMPLETION_PATH}

# How it ended (`outcome`): continued, or why not.
CONTINUED = "continued"
RESENT = "resent_whole"  # a whole (not streamed) answer that broke before any of it was sent: asked for again
NO_REPLICA = "no_replica"
LIMIT = "limit"

# A completion's default length when the request names none (OpenAI's and vLLM's).
COMPLETION_DEFAULT_MAX_TOKENS = 16

# The fields of a request that say how to sample and when to stop: every leg sends them as the client did.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "priority",
    "user",
)
# Guided decoding: the constraint's state is the engine's, and is not re-entered by a continuation.
_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")

_EVENT_END = re.compile(rb"\r?\n\r?\n")
# Token ids the router asked for and the client did not: taken out of each event relayed (vLLM puts them last).
# vLLM also adds an empty `prompt_text` to a chat stream's first event when asked for ids.
TOKEN_IDS_FIELDS = re.compile(rb',\s*"(?:(?:prompt_)?token_ids"\s*:\s*(?:\[[^\]]*\]|null)|prompt_text"\s*:\s*null)')
_RETURN_TOKEN_IDS = b',"return_token_ids":true}'
# An engine's own unfinished end: vLLM's finish reason for a request its sleep (mode=abort) or shutdown cut, and
# the error event it sends for a request-level failure (GenerationError). Text in a delta has its quotes escaped.
_UNFINISHED = re.compile(rb'"finish_reason":\s*"(?:abort|error)"|^data:\s*\{\s*"error"', re.MULTILINE)


def check_finished_well(chunk: bytes) -> None:
    """Raise EngineEndedUnfinished if `chunk` (whole events) ends the answer unfinished. Two substring scans for
    the usual chunk; the pattern only where one of the words is in it."""
    if (b'"abort"' in chunk or b'"error"' in chunk) and (match := _UNFINISHED.search(chunk)) is not None:
        raise EngineEndedUnfinished(chunk[match.start() :])


class _Delta(msgspec.Struct):
    """A chat event's delta as a continuation reads it (every other field skipped, not decoded)."""

    content: str | None = None
    tool_calls: object = None
    function_call: object = None
    reasoning_content: object = None
    reasoning: object = None


class EventChoice(msgspec.Struct):
    """One choice of a chat or text completion event: a chat's delta or a completion's text, and vLLM's ids."""

    index: int = 0
    delta: _Delta | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None


class Event(msgspec.Struct):
    """An event of a chat or text completion stream as a continuation reads it; `choices` None: not one of its
    answer's events (an error event, say). Every event repeats the answer's id, `created` and model: they are
    read from the first only (`_FirstEvent`)."""

    prompt_token_ids: list[int] | None = None
    choices: list[EventChoice] | None = None
    usage: dict[str, Any] | None = None


class _FirstEvent(Event):
    id: object = None
    created: object = None
    model: object = None


decode_event = msgspec.json.Decoder(Event).decode
_decode_first = msgspec.json.Decoder(_FirstEvent).decode
encode_json = msgspec.json.Encoder().encode


@dataclass(slots=True)
class Answer:
    """What the client has been sent of one answer (choice 0), read from the transcript and kept up to date
    by every later leg: enough to ask another replica for the rest and to stitch it on."""

    ident: object = None
    created: object = None
    model: object = None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] | None = field(default_factory=list)  # None once a content event came without them
    prompt_ids: list[int] | None = None
    chunks: int = 0  # events with content: the tokens produced, where the engine sends one per event
    shown: int = 0  # of `token_ids`, those up to the last whose text was sent (the rest are held back)
    finish: str | None = None
    tool_call: bool = False
    reasoning: bool = False

    @property
    def produced(self) -> int:
        """Tokens produced so far whose text the client has: counted by id where every event had them (the last
        ones whose text the engine still held back are made again), else one per content event."""
        return self.shown if self.token_ids is not None else self.chunks

    def read(self, event: Event) -> None:
        """Take in one event of the stream (as the client got it)."""
        if event.prompt_token_ids is not None:
            self.prompt_ids = event.prompt_token_ids
        for choice in event.choices or ():
            if choice.index == 0:
                if choice.prompt_token_ids is not None:
                    self.prompt_ids = choice.prompt_token_ids
                self.read_choice(choice)

    def read_choice(self, choice: EventChoice) -> None:
        """Take in one choice of an event: its text, token ids, finish reason, and whether it began a tool call
        or reasoning (a continuation leg's own prompt ids are not the client's, so they are not read here)."""
        delta = choice.delta
        if delta is not None:
            text = delta.content
            self.tool_call |= bool(delta.tool_calls or delta.function_call)
            self.reasoning |= bool(delta.reasoning_content or delta.reasoning)
        else:
            text = choice.text
        ids = choice.token_ids
        # Even with no text: a detokenizer holds back the bytes of a character not yet whole, not its tokens.
        if ids is not None and self.token_ids is not None:
            self.token_ids.extend(ids)
        if text:
            self.text.append(text)
            self.chunks += 1
            if ids is None:
                self.token_ids = None  # text whose tokens are unknown: the rest can only follow the text
            elif self.token_ids is not None:
                self.shown = len(self.token_ids)
        if choice.finish_reason:
            self.finish = choice.finish_reason

    def exact(self) -> bool:
        """Whether the rest can be asked for by token ids (every event gave its ids, and the prompt's)."""
        return self.prompt_ids is not None and self.token_ids is not None

    def shown_ids(self) -> list[int]:
        """The generated ids whose text the client has. A detokenizer holds back the first tokens of a character
        made of several; a fresh one, primed with them as a prompt, would not make it whole from the rest, so the
        continuation makes them again (at temperature 0, the same ones) and sends their text."""
        assert self.token_ids is not None
        return self.token_ids[: self.shown]


def events(raw: bytes) -> list[bytes]:
    """The data of each event in `raw` (whole SSE events), comments and other fields left out."""
    if b"\r" in raw:
        return [data for event in _EVENT_END.split(raw) if (data := _event_data(event)) is not None]
    # An engine's event is one data line ("data: {...}\n\n"; JSON escapes a newline in a string): one split
    # reads them all, and when the newlines are only those it split on, every event was. A continuation reads a
    # first leg's transcript, a thousand events, while its client waits.
    if raw.startswith(b"data: ") and raw.endswith(b"\n\n"):
        found = raw[6:-2].split(b"\n\ndata: ")
        if raw.count(b"\n") == 2 * len(found):
            return found
    # Otherwise event by event, reading lines only where there are several.
    found = []
    for event in raw.split(b"\n\n"):
        if b"\n" not in event:
            if event.startswith(b"data:"):
                found.append(event[5:].strip())
        elif (data := _event_data(event)) is not None:
            found.append(data)
    return found


def _event_data(event: bytes) -> bytes | None:
    lines = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def read_answer(raw: bytes) -> Answer:
    """What the client was sent in `raw`, the relayed bytes of a stream's first leg."""
    answer = Answer()
    for data in events(raw):
        if data == b"[DONE]":
            continue
        try:
            if answer.ident is None:
                first = _decode_first(data)
                answer.ident, answer.created, answer.model = first.id, first.created, first.model
                answer.read(first)
            else:
                answer.read(decode_event(data))
        except msgspec.DecodeError:  # an event the engine did not make, or made wrong: it has no text to keep
            continue
    return answer


def refusal(path: str, payload: dict[str, Any], answer: Answer) -> str | None:
    """Why continuing this answer would change it (an outcome label), or None if it may be continued."""
    if any(isinstance(payload.get(name), int) and payload[name] > 1 for name in ("n", "best_of")):
        return "n"
    response_format = payload.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return "guided"
    if any(payload.get(name) is not None for name in _GUIDED_FIELDS):
        return "guided"
    if payload.get("logprobs") or payload.get("top_logprobs") or payload.get("prompt_logprobs"):
        return "logprobs"
    if answer.tool_call:
        return "tool_call"
    if answer.reasoning:
        return "reasoning"
    if path == COMPLETION_PATH and (payload.get("echo") or payload.get("suffix") or not _one_prompt(payload)):
        return "echo_or_prompts"
    return None


def _one_prompt(payload: dict[str, Any]) -> bool:
    """Whether a completion request has one prompt, as text or token ids (not a batch of prompts)."""
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, list) and (
        all(isinstance(p, int) for p in prompt) or (len(prompt) == 1 and isinstance(prompt[0], str))
    )


def remaining_tokens(path: str, payload: dict[str, Any], produced: int) -> int | None:
    """What is left of the request's token budget (None: no limit was set, so none is sent)."""
    limit = payload.get("max_completion_tokens", payload.get("max_tokens"))
    if limit is None and path == COMPLETION_PATH:
        limit = COMPLETION_DEFAULT_MAX_TOKENS
    if not isinstance(limit, int):
        return None
    return limit - produced


def continuation(path: str, payload: dict[str, Any], answer: Answer, exact: bool) -> tuple[str, dict[str, Any]]:
    """(path, body) asking a replica for the rest of `answer` to the request `payload` sent to `path`."""
    left = remaining_tokens(path, payload, answer.produced)
    body: dict[str, Any] = {name: payload[name] for name in SAMPLING_FIELDS if name in payload}
    body.update(model=payload["model"], stream=True, stream_options={"include_usage": True})
    if exact:
        assert answer.prompt_ids is not None  # exact() said so
        # A chat without a limit may run to the model's context: vLLM takes an explicit null as that.
        body.update(prompt=answer.prompt_ids + answer.shown_ids(), max_tokens=left, return_token_ids=True)
        return COMPLETION_PATH, body
    text = "".join(answer.text)
    if path in CHAT_PATHS:
        # No text yet (a detokenizer may hold back a character's first tokens): the request asked again.
        final = [{"role": "assistant", "content": text}] if text else []
        messages = [*payload["messages"], *final]
        for name in ("tools", "tool_choice", "parallel_tool_calls", "chat_template", "chat_template_kwargs"):
            if name in payload:
                body[name] = payload[name]
        body["messages"] = messages
        if text:
            body.update(continue_final_message=True, add_generation_prompt=False)
        if left is not None:
            body["max_completion_tokens" if "max_completion_tokens" in payload else "max_tokens"] = left
        return path, body
    prompt = payload["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    body.update(prompt=prompt + text if isinstance(prompt, str) else prompt, max_tokens=left)
    return path, body


def ask_for_token_ids(body: bytes) -> bytes:
    """A streamed request's body (a JSON object, already checked) also asking for token ids."""
    end = body.rstrip()
    return end[:-1] + _RETURN_TOKEN_IDS if end.endswith(b"}") else body
