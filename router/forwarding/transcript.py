"""What a continuable stream keeps as it is relayed, and how a continuation's events join it.

A stream's first leg is read by `KeptSseUsage`: each whole event is kept as
the engine sent it (one list append), nothing parsed while the answer flows.
At the first break the `Transcript` reads them once into an `Answer`
(router.forwarding.continuation), and every later leg is read by `Splice`,
which rewrites its events so the client's stream reads as one answer and
keeps that answer up to date for a further break.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from router.accounting.usage_reader import SseUsage
from router.endpoints.table import Endpoint
from router.forwarding.continuation import (
    TOKEN_IDS_FIELDS,
    Answer,
    EventChoice,
    check_finished_well,
    decode_event,
    encode_json,
    events,
    read_answer,
)


class Transcript:
    """One continuable stream: what its first leg relayed, why it broke, how many times it was continued.

    `kept` holds the first leg's whole events; later legs keep the answer up to
    date instead (`Splice`). `broken` (the replica, the error) is set by the
    relay when the engine broke off, for the proxy to continue from or end.
    """

    # Defaults on the class: a stream that never breaks sets only what __init__ does.
    answer: Answer | None = None
    broken: tuple[Endpoint, BaseException] | None = None
    migrations = 0
    mark = 0  # tokens produced when the stream was last continued
    fruitless = 0  # continuations in a row that brought no token (LLMGW_STREAM_MIGRATIONS bounds it)
    charged = False  # the last continuation counts in `fruitless` (it was no move: router.forwarding.moves)
    reprocessed = 0  # prompt tokens the continuations made engines read again (not the client's usage)
    path = ""  # the client's path and request, as first sent: read at the first break
    payload: dict[str, Any] = {}  # noqa: RUF012  (replaced, never changed in place)
    last_sent = 0.0  # when the client last got a chunk before the last break (time.perf_counter)
    gap: float | None = None  # from it to the next leg's first chunk relayed, once relayed
    refused: tuple[Endpoint, ...] = ()  # replicas that failed a leg before answering, since the stream last moved on
    counted = False  # the request was counted against its key (by its last leg, or when it was ended)

    def __init__(self, chat: bool, client_ids: bool, asked_ids: bool) -> None:
        self.chat = chat  # the client asked for a chat completion (a token-exact leg is a text completion)
        self.kept: list[bytes] = []
        self.client_ids = client_ids  # the client asked for token ids itself: they stay in what it gets
        self.strip_ids = asked_ids and not client_ids

    def read(self) -> Answer:
        """The answer so far, read from the first leg's events once."""
        if self.answer is None:
            self.answer = read_answer(b"".join(self.kept))
            self.kept = []
        return self.answer

    def reader(self, pass_usage: bool) -> SseUsage:
        """What reads the next leg as it is relayed: the first is kept as it is read (KeptSseUsage); a later one
        is spliced in, its answer kept up to date instead."""
        if self.answer is not None:
            return Splice(pass_usage, self)
        return KeptSseUsage(pass_usage, self)


class KeptSseUsage(SseUsage):
    """The usage reader of a continuable stream's first leg: keeps each whole event as the engine sent it (one
    list append), and relays it without the token ids the router asked for. An engine's own unfinished end is
    raised (EngineEndedUnfinished) before it is kept or relayed."""

    __slots__ = ("_transcript",)

    def __init__(self, pass_usage: bool, transcript: Transcript) -> None:
        SseUsage.__init__(self, pass_usage)
        self._transcript = transcript

    def feed(self, chunk: bytes) -> bytes:
        # SseUsage.feed and the test of check_finished_well written out: no super() object, and no call, per chunk.
        chunk = SseUsage.feed(self, chunk)
        if chunk:
            if b'"abort"' in chunk or b'"error"' in chunk:
                check_finished_well(chunk)
            transcript = self._transcript
            transcript.kept.append(chunk)
            if transcript.strip_ids and b"token_ids" in chunk:
                chunk = TOKEN_IDS_FIELDS.sub(b"", chunk)
        return chunk

    def finish(self) -> bytes:
        rest = super().finish()
        if rest:
            check_finished_well(rest)
            self._transcript.kept.append(rest)
            if self._transcript.strip_ids:
                rest = TOKEN_IDS_FIELDS.sub(b"", rest)
        return rest


class Splice(SseUsage):
    """The reader of a continuation leg: rewrites each event so the client's stream reads as one answer.

    Events carry the first leg's id, `created` and model; a chat's role delta
    is not sent twice; a text completion answering a chat (token-exact) becomes
    chat deltas; the usage chunk counts the client's prompt once and the
    completion tokens of every leg. The answer is updated as events pass, for
    a further continuation.
    """

    __slots__ = ("_transcript", "_chat", "_before", "_repeated")

    def __init__(self, pass_usage: bool, transcript: Transcript) -> None:
        super().__init__(pass_usage)
        self._transcript = transcript
        self._chat = transcript.chat
        answer = transcript.answer
        assert answer is not None  # a splice follows a first leg, read
        self._before = answer.produced
        # The tokens whose text was held back are made again by this leg: their ids, already sent to a client
        # that asked for ids, are not sent twice, and the answer goes on from the last token shown.
        self._repeated = 0
        if answer.token_ids is not None:
            self._repeated = len(answer.token_ids) - answer.shown
            del answer.token_ids[answer.shown :]

    def feed(self, chunk: bytes) -> bytes:
        if self._carry:
            chunk = self._carry + chunk
            self._carry = b""
        end = chunk.rfind(b"\n\n") + 2  # 1 when no event ends in it: all of it waits for the rest
        self._carry, chunk = chunk[end:] if end > 1 else chunk, chunk[:end] if end > 1 else b""
        if not chunk:
            return b""
        check_finished_well(chunk)  # before any of it changes the answer
        return b"".join(self._event(data) for data in events(chunk))

    def finish(self) -> bytes:
        rest, self._carry = self._carry, b""
        if not rest:
            return b""
        check_finished_well(rest)
        return b"".join(self._event(data) for data in events(rest))

    def _event(self, data: bytes) -> bytes:
        if data == b"[DONE]":
            return b"data: [DONE]\n\n"
        try:
            payload = decode_event(data)
        except msgspec.DecodeError:
            payload = None
        if payload is None or payload.choices is None:
            return b"data: " + data + b"\n\n"  # an error event, say: passed on as the engine sent it
        answer = self._transcript.answer
        assert answer is not None
        choices = [out for choice in payload.choices if (out := self._choice(choice, answer)) is not None]
        transcript = self._transcript
        if choices and transcript.gap is None:
            transcript.gap = time.perf_counter() - transcript.last_sent
        usage = payload.usage
        if usage is not None:
            usage = self._usage(usage, answer)
            if not choices and not self._pass_usage:
                return b""
        elif not choices:
            return b""
        event: dict[str, Any] = {
            "id": answer.ident,
            "object": "chat.completion.chunk" if self._chat else "text_completion",
        }
        event.update(created=answer.created, model=answer.model, choices=choices)
        if usage is not None and self._pass_usage:
            event["usage"] = usage
        return b"data: " + encode_json(event) + b"\n\n"

    def _choice(self, choice: EventChoice, answer: Answer) -> dict[str, Any] | None:
        """The client's form of one choice of a continuation event, or None for one it must not get."""
        text = choice.delta.content if choice.delta is not None else choice.text
        finish = choice.finish_reason
        answer.read_choice(choice)
        ids = self._client_ids(choice.token_ids) if self._transcript.client_ids else None
        if not text and not finish and not ids:
            return None  # a role delta, or an empty one: the client has had its start
        out: dict[str, Any] = {"index": 0}
        if self._chat:
            out["delta"] = {"content": text} if text else {}
        else:
            out["text"] = text or ""
        out.update(logprobs=None, finish_reason=finish)
        if ids is not None:
            out["token_ids"] = ids
        return out

    def _client_ids(self, ids: list[int] | None) -> list[int] | None:
        """The ids of a choice the client is still owed: those it had already, made again, are left out."""
        if ids is None or not self._repeated:
            return ids
        skipped = min(self._repeated, len(ids))
        self._repeated -= skipped
        return ids[skipped:]

    def _usage(self, usage: dict[str, Any], answer: Answer) -> dict[str, Any] | None:
        """The whole request's usage from this leg's: the client's prompt once, every leg's completion."""
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return None
        before = self._before
        self._transcript.reprocessed += prompt
        # This leg's prompt is the client's and what came before (by ids, or re-tokenized from the text).
        client_prompt = len(answer.prompt_ids) if answer.prompt_ids is not None else max(0, prompt - before)
        total = {"prompt_tokens": client_prompt, "completion_tokens": before + completion}
        total["total_tokens"] = client_prompt + before + completion
        self._found = (client_prompt, before + completion)
        return total
