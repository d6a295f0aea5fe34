"""Token accounting in the router: the usage of engines' answers, read as they are relayed.

Nothing here does I/O or holds state beyond one answer; router.accounting.counter
counts what is read per key and model (DESIGN invariant 4).

* Non-streamed JSON answers: `usage` is the last `"usage": {...}` in the
  answer's last `JSON_TAIL_BYTES` (engines put it at the end), decoded alone —
  never the whole of a long body. A short answer read whole is decoded whole
  instead, skipping everything but its top-level `usage` (that is cheaper
  than searching it); one too long to read whole is relayed as it arrives,
  keeping only its tail.
* Streams: `ask_for_usage` rewrites a request that did not ask for usage to
  add `stream_options.include_usage`, and `SseUsage` finds the event carrying
  a non-null `usage` (the last one wins) and drops it again when the client
  did not ask for it. Every other byte passes unchanged.

Those are OpenAI's chat, completions and embeddings shapes: `usage` with
`prompt_tokens` and `completion_tokens`. Anthropic's Messages API and OpenAI's
Responses API (`IN_OUT_USAGE_PATHS`: vLLM, SGLang and llama.cpp serve both)
count `input_tokens` and `output_tokens` instead, and send them in every
answer, streamed or not, so their streams are never asked for usage and
nothing of them is ever dropped:

* a JSON answer has them in its top-level `usage` (a Responses one with
  nested `*_tokens_details`, skipped), read as above;
* an Anthropic stream in `message_start` (`message.usage`: the input) and
  `message_delta` (`usage`: the output so far, and on vLLM the input again;
  on SGLang and llama.cpp the output alone), a Responses stream in its last
  event (`response.completed`, or `.incomplete`/`.failed`: `response.usage`).
  `InOutSseUsage` reads each and keeps the latest input and the latest
  output, passing every byte through as the engine sent it.

Prompt tokens are `input_tokens` plus Anthropic's `cache_read_input_tokens`
and `cache_creation_input_tokens`, which Anthropic's `input_tokens` leaves out
(a Responses `input_tokens` includes its cached tokens, reported apart in its
details): the same prompt counts the same on every API. Token counting
(`/v1/messages/count_tokens`, `*/input_tokens`) answers `input_tokens` with no
`usage`: it generates nothing and counts as a request with no tokens.

A malformed or missing usage counts no tokens and never fails a request.
"""

from __future__ import annotations

import json
import re
from typing import Annotated

import msgspec

# A usage object is read from the end of a JSON answer; it sits within the last few hundred bytes in
# every engine we know (vLLM, SGLang, llama.cpp, TGI), so 64 KiB leaves room for trailing extras.
JSON_TAIL_BYTES = 64 * 1024
# A whole answer up to this size is decoded whole for its usage instead (see usage_of_whole_answer).
WHOLE_DECODE_BYTES = 2048
# An SSE event not yet ended is held back until it is (the client cannot use half an event anyway);
# one longer than this is passed on unread, so a stream without recognisable framing is never stalled.
SSE_CARRY_BYTES = 64 * 1024
# The same where an event carries a whole answer before its usage (the Responses API's last): held up to this.
IN_OUT_SSE_CARRY_BYTES = 1024 * 1024
# More tokens than this in one answer is not a count but garbage.
MAX_TOKENS = 1 << 40

_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
_EVENT_END = re.compile(rb"\r?\n\r?\n")
_USAGE_OPTION = b',"stream_options":{"include_usage":true}}'
_DECODER = json.JSONDecoder()  # built once: constructing one costs more than decoding a usage object

# Where answers count input and output tokens, and always carry them (the paths as engines serve them).
IN_OUT_USAGE_PATHS = frozenset({"/v1/messages", "/v1/responses", "/responses"})

_Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]


class _Usage(msgspec.Struct):
    """An engine's `usage` object: the one definition of a usable one, whichever way it is read.

    Embeddings' usage has no completion tokens: they count as 0. Anything else
    (a bool, a float, a negative or absurd count) makes it unusable.
    """

    prompt_tokens: _Count
    completion_tokens: _Count | None = 0

    def counts(self) -> tuple[int, int]:
        """(prompt tokens, completion tokens)."""
        return self.prompt_tokens, self.completion_tokens or 0


class _InOutUsage(msgspec.Struct):
    """A `usage` object of Anthropic's Messages API or OpenAI's Responses API (`IN_OUT_USAGE_PATHS`).

    Each count may be missing: a `message_delta` event may carry the output
    alone. Anthropic's cache counts are part of the prompt (its
    `input_tokens` leaves them out); a Responses usage has none of them.
    """

    input_tokens: _Count | None = None
    output_tokens: _Count | None = None
    cache_read_input_tokens: _Count | None = None
    cache_creation_input_tokens: _Count | None = None

    def prompt(self) -> int | None:
        """The prompt tokens, or None if this usage does not count the input."""
        if self.input_tokens is None:
            return None
        return self.input_tokens + (self.cache_read_input_tokens or 0) + (self.cache_creation_input_tokens or 0)

    def counts(self) -> tuple[int, int] | None:
        """(prompt tokens, completion tokens), or None for a usage that counts neither."""
        prompt = self.prompt()
        if prompt is None and self.output_tokens is None:
            return None
        return prompt or 0, self.output_tokens or 0


class _Answer(msgspec.Struct):
    """A whole JSON answer as far as accounting reads it: its top-level `usage`, every other field skipped
    (skipped, not decoded: an answer's choices are most of its bytes)."""

    usage: _Usage | None = None


class _Event(_Answer):
    """An SSE event as far as accounting reads it: its `usage`, and whether it has choices (a usage-only
    event is the one a client that did not ask for usage must not get)."""

    choices: object = None


class _InOutAnswer(msgspec.Struct):
    """A whole answer, or the message or response an event carries, on `IN_OUT_USAGE_PATHS`: its `usage`."""

    usage: _InOutUsage | None = None


class _InOutEvent(_InOutAnswer):
    """An SSE event on `IN_OUT_USAGE_PATHS`: its own `usage` (Anthropic's `message_delta`), its message's
    (`message_start`) or its response's (the Responses API's last event)."""

    message: _InOutAnswer | None = None
    response: _InOutAnswer | None = None

    def found(self) -> _InOutUsage | None:
        """The usage this event carries, if any."""
        if self.usage is not None:
            return self.usage
        holder = self.message or self.response
        return None if holder is None else holder.usage


_UsageDecoder = msgspec.json.Decoder[_Usage] | msgspec.json.Decoder[_InOutUsage]
_USAGE_DECODER = msgspec.json.Decoder(_Usage)
_ANSWER_DECODER = msgspec.json.Decoder(_Answer)
_EVENT_DECODER = msgspec.json.Decoder(_Event)
_IN_OUT_USAGE_DECODER = msgspec.json.Decoder(_InOutUsage)
_IN_OUT_ANSWER_DECODER = msgspec.json.Decoder(_InOutAnswer)
_IN_OUT_EVENT_DECODER = msgspec.json.Decoder(_InOutEvent)


def ask_for_usage(body: bytes) -> tuple[bytes, bool]:
    """(the body to send the engine, whether the client asked for the usage chunk itself) for a streamed request.

    `body` is a JSON object with `"stream": true` (the app has checked it).
    Without `stream_options` the option is appended to the body's bytes (last,
    so a duplicate key spelled with escapes cannot override it); otherwise the
    body is parsed and `include_usage` added to the client's options. Options
    that are not an object are left for the engine to refuse.
    """
    if b"stream_options" not in body:
        end = body.rstrip()
        if end.endswith(b"}"):
            return end[:-1] + _USAGE_OPTION, False
    try:
        payload = json.loads(body)
    except ValueError:
        return body, True
    if not isinstance(payload, dict):
        return body, True
    options = payload.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        return body, True
    if options.get("include_usage") is True:
        return body, True
    payload["stream_options"] = {**options, "include_usage": True}
    return json.dumps(payload).encode(), False


def read_usage(usage: object, shape: type[_Usage] | type[_InOutUsage] = _Usage) -> tuple[int, int] | None:
    """(prompt tokens, completion tokens) from a decoded `usage` object of `shape` (OpenAI's chat one, or
    `_InOutUsage`), or None if it is not a usable one."""
    try:
        return msgspec.convert(usage, shape).counts()
    except msgspec.ValidationError:
        return None


def usage_in_json_tail(tail: bytes, decoder: _UsageDecoder = _USAGE_DECODER) -> tuple[int, int] | None:
    """The usage of a JSON answer from its last bytes: the last `"usage": {...}` decoded on its own
    (by `decoder`: OpenAI's chat shape unless told)."""
    # The last `"usage"` is almost always the key sought: try it first, and search before it only if not.
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    start = tail.find(b"{", at + 7, at + 64)  # at the object's "{", if only a colon stands between
    if start < 0 or tail[at + 7 : start].strip() != b":":
        start = -1
        for found in _USAGE_OBJECT.finditer(tail):
            start = found.end() - 1
        if start < 0:
            return None
    end = tail.find(b"}", start)
    if end > 0 and tail.find(b"{", start + 1, end) < 0:
        # A flat object (the usual usage): decoded and checked alone, in C.
        try:
            usage = decoder.decode(tail[start : end + 1])
        except msgspec.ValidationError:
            return None  # a whole object, but not a usable usage
        except msgspec.DecodeError:
            pass  # a brace inside a string, say: the general path below reads it
        else:
            return usage.counts()
    try:
        usage, _ = _DECODER.raw_decode(tail[start:].decode("utf-8", "replace"))
    except ValueError:
        return None
    return read_usage(usage, _InOutUsage if decoder is _IN_OUT_USAGE_DECODER else _Usage)


def usage_of_whole_answer(
    content_type: str, content_encoding: str, body: bytes, path: str = ""
) -> tuple[int, int] | None:
    """The usage of a JSON answer to `path` read whole (one of another type, or compressed, is not read).

    A short answer (a chat completion, usually) is decoded whole, skipping all
    but its top-level `usage`, which costs less than searching it; a longer one
    (embeddings: mostly numbers, slow to skip) by its tail.
    """
    if (content_encoding and content_encoding != "identity") or not content_type.startswith("application/json"):
        return None
    if path in IN_OUT_USAGE_PATHS:
        return _in_out_usage_of_whole_answer(body)
    if len(body) > WHOLE_DECODE_BYTES:
        return usage_in_json_tail(body[-JSON_TAIL_BYTES:])
    try:
        usage = _ANSWER_DECODER.decode(body).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    # Not usage.counts(): a call less on the path of every JSON answer.
    return None if usage is None else (usage.prompt_tokens, usage.completion_tokens or 0)


def _in_out_usage_of_whole_answer(body: bytes) -> tuple[int, int] | None:
    """usage_of_whole_answer for an answer on `IN_OUT_USAGE_PATHS`."""
    if len(body) > WHOLE_DECODE_BYTES:
        return usage_in_json_tail(body[-JSON_TAIL_BYTES:], _IN_OUT_USAGE_DECODER)
    try:
        usage = _IN_OUT_ANSWER_DECODER.decode(body).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return None if usage is None else usage.counts()


class JsonUsage:
    """Keeps the tail of a non-streamed answer as it is relayed, to read its usage at the end."""

    __slots__ = ("_chunks", "_size")
    drops = False

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> bytes:
        chunks = self._chunks
        chunks.append(chunk)
        self._size += len(chunk)
        while self._size - len(chunks[0]) >= JSON_TAIL_BYTES:
            self._size -= len(chunks.pop(0))
        return chunk

    def finish(self) -> bytes:
        return b""

    def usage(self) -> tuple[int, int] | None:
        chunks = self._chunks
        if not chunks:
            return None
        return usage_in_json_tail(chunks[0] if len(chunks) == 1 else b"".join(chunks))


class InOutJsonUsage(JsonUsage):
    """JsonUsage for an answer on `IN_OUT_USAGE_PATHS`: its usage counts input and output tokens."""

    __slots__ = ()

    def usage(self) -> tuple[int, int] | None:
        chunks = self._chunks
        if not chunks:
            return None
        return usage_in_json_tail(b"".join(chunks), _IN_OUT_USAGE_DECODER)


class SseUsage:
    """Reads the usage event of an SSE stream as it is relayed, and drops it unless the client asked for it.

    Complete events pass at once; an event not yet ended is held until it is.
    Only the event whose JSON has a non-null `usage` and no choices is dropped
    (an engine that puts usage on a content chunk keeps it: the content matters more).
    """

    __slots__ = ("_carry", "_found", "_pass_usage", "drops")
    carry_limit = SSE_CARRY_BYTES

    def __init__(self, pass_usage: bool) -> None:
        self._pass_usage = pass_usage
        self.drops = not pass_usage  # the body may shrink: its Content-Length, if any, must go
        self._carry = b""
        self._found: tuple[int, int] | None = None

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to relay now for `chunk` (possibly none, while an event is incomplete)."""
        if not self._carry and chunk[-2:] == b"\n\n":
            # Whole events (the usual read): nothing to hold back, and most carry no usage at all.
            if b'"usage"' not in chunk or _USAGE_OBJECT.search(chunk) is None:
                return chunk
            return self._take_usage(chunk)
        if self._carry:
            chunk = self._carry + chunk
            self._carry = b""
        lf, crlf = chunk.rfind(b"\n\n"), chunk.rfind(b"\n\r\n")
        end = max(lf + 2 if lf >= 0 else -1, crlf + 3 if crlf >= 0 else -1)
        if end < len(chunk):
            rest = chunk[end:] if end >= 0 else chunk
            if len(rest) <= self.carry_limit:
                self._carry = rest
                chunk = chunk[:end] if end >= 0 else b""
        if _USAGE_OBJECT.search(chunk) is None:
            return chunk
        return self._take_usage(chunk)

    def finish(self) -> bytes:
        """What is left at the end of the stream (an event without its blank line), to relay last."""
        rest, self._carry = self._carry, b""
        if rest and _USAGE_OBJECT.search(rest) is not None:
            return self._take_usage(rest)
        return rest

    def usage(self) -> tuple[int, int] | None:
        return self._found

    def _take_usage(self, chunk: bytes) -> bytes:
        kept: list[bytes] = []
        start = 0
        for end in [m.end() for m in _EVENT_END.finditer(chunk)] + [len(chunk)]:
            event = chunk[start:end]
            start = end
            if not event:
                continue
            if _USAGE_OBJECT.search(event) is not None and self._read_event(event) and not self._pass_usage:
                continue
            kept.append(event)
        return b"".join(kept)

    def _read_event(self, event: bytes) -> bool:
        """Record the usage of `event`; whether it is the usage-only event (no choices) that may be dropped."""
        lines = [line[5:] for line in event.splitlines() if line.startswith(b"data:")]
        try:
            payload = _EVENT_DECODER.decode(b"\n".join(lines))
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        if payload.usage is None:
            return False
        self._found = payload.usage.counts()
        return not payload.choices


class InOutSseUsage(SseUsage):
    """Reads the usage of a stream on `IN_OUT_USAGE_PATHS` as it is relayed, dropping nothing.

    Anthropic's streams count the input in `message_start` and the output
    (so far: the last wins) in `message_delta`, which may count the input
    again or not; a Responses stream counts both in its last event, after the
    whole answer. That event is held whole up to `carry_limit`; past it, it
    is passed on in pieces and its usage read from the tail of its last piece.
    """

    __slots__ = ()
    carry_limit = IN_OUT_SSE_CARRY_BYTES

    def __init__(self) -> None:
        super().__init__(pass_usage=True)

    def _read_event(self, event: bytes) -> bool:
        """Record the usage `event` carries, merged with what earlier events counted; never drop it."""
        lines = [line[5:] for line in event.splitlines() if line.startswith(b"data:")]
        try:
            usage = _IN_OUT_EVENT_DECODER.decode(b"\n".join(lines)).found()
        except msgspec.ValidationError:
            return False
        except msgspec.DecodeError:
            # Not a whole event: the last piece of one too long to hold, whose usage ends it.
            self._found = usage_in_json_tail(event[-JSON_TAIL_BYTES:], _IN_OUT_USAGE_DECODER) or self._found
            return False
        if usage is not None:
            prompt, output = usage.prompt(), usage.output_tokens
            if prompt is not None or output is not None:
                before = self._found or (0, 0)
                self._found = (before[0] if prompt is None else prompt, before[1] if output is None else output)
        return False


def usage_reader(
    content_type: str, content_encoding: str, pass_usage: bool, path: str = ""
) -> JsonUsage | SseUsage | None:
    """What reads the usage of an answer of this type to `path` as it is relayed; None when it cannot be read.

    Engines are asked for identity (router/forwarding/headers.py); a body one compressed all the same is relayed unread.
    """
    if content_encoding and content_encoding != "identity":
        return None
    if content_type.startswith("text/event-stream"):
        return SseUsage(pass_usage) if path not in IN_OUT_USAGE_PATHS else InOutSseUsage()
    if content_type.startswith("application/json"):
        return JsonUsage() if path not in IN_OUT_USAGE_PATHS else InOutJsonUsage()
    return None
