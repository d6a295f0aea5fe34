"""What a broken stream's continuation asks for and how its events are stitched on (router.forwarding.continuation):
the first leg read back from its relayed bytes, the refusals, the next leg's request, and the spliced events."""

from __future__ import annotations

import json

import pytest

from router.errors import EngineEndedUnfinished
from router.forwarding.continuation import (
    COMPLETION_PATH,
    check_finished_well,
    continuation,
    events,
    read_answer,
    refusal,
    remaining_tokens,
)
from router.forwarding.transcript import Transcript

CHAT = "/v1/chat/completions"


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def chat_chunk(content: str | None = None, *, role: bool = False, finish=None, ids=None, prompt_ids=None) -> bytes:
    delta = {"role": "assistant", "content": ""} if role else {"content": content}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    payload = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": [choice]}
    if prompt_ids is not None:
        payload["prompt_token_ids"] = prompt_ids
    return event(payload)


def completion_chunk(text: str, *, finish=None, ids=None, prompt_ids=None, ident="cmpl-2", created=9) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    if prompt_ids is not None:
        choice["prompt_token_ids"] = prompt_ids
    return event({"id": ident, "object": "text_completion", "created": created, "model": "m", "choices": [choice]})


def usage_chunk(prompt: int, completion: int, ident="cmpl-2") -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return event({"id": ident, "object": "text_completion", "created": 9, "model": "m", "choices": [], "usage": usage})


def test_the_first_leg_is_read_back_from_the_bytes_relayed():
    raw = chat_chunk(role=True, prompt_ids=[1, 2, 3]) + chat_chunk("Hel", ids=[10]) + chat_chunk("lo", ids=[11])
    answer = read_answer(raw + b": keep-alive\n\n")
    assert (answer.ident, answer.created, answer.model) == ("chatcmpl-1", 7, "m")
    assert answer.text == ["Hel", "lo"] and answer.token_ids == [10, 11] and answer.prompt_ids == [1, 2, 3]
    assert answer.produced == 2 and answer.exact() and answer.finish is None


def test_without_token_ids_the_tokens_are_counted_by_events_and_only_text_continues():
    answer = read_answer(chat_chunk(role=True) + chat_chunk("a", ids=[5]) + chat_chunk(" b"))
    assert answer.token_ids is None and answer.produced == 2 and not answer.exact()


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ({"n": 2}, "n"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "guided"),
        ({"response_format": {"type": "json_object"}}, "guided"),
        ({"guided_json": {"type": "object"}}, "guided"),
        ({"structured_outputs": {"regex": "a+"}}, "guided"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "logprobs"),
        ({"response_format": {"type": "text"}}, None),
        ({"n": 1, "temperature": 0}, None),
    ],
)
def test_requests_whose_answer_a_continuation_would_change_are_refused(payload, why):
    answer = read_answer(chat_chunk("x"))
    assert refusal(CHAT, {"messages": [], **payload}, answer) == why


def test_a_tool_call_or_reasoning_already_begun_is_refused():
    tool = {"index": 0, "id": "t", "type": "function", "function": {"name": "f", "arguments": "{"}}
    begun = event({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [tool]}, "finish_reason": None}]})
    assert refusal(CHAT, {"messages": []}, read_answer(begun)) == "tool_call"
    thinking = event({"id": "c", "choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]})
    assert refusal(CHAT, {"messages": []}, read_answer(thinking)) == "reasoning"


def test_completions_that_echo_or_batch_prompts_are_refused():
    answer = read_answer(completion_chunk(" x"))
    assert refusal(COMPLETION_PATH, {"prompt": "p", "echo": True}, answer) == "echo_or_prompts"
    assert refusal(COMPLETION_PATH, {"prompt": ["p", "q"]}, answer) == "echo_or_prompts"
    assert refusal(COMPLETION_PATH, {"prompt": [1, 2, 3]}, answer) is None
    assert refusal(COMPLETION_PATH, {"prompt": ["p"]}, answer) is None


def test_the_budget_left_is_the_limit_less_what_was_produced():
    assert remaining_tokens(CHAT, {"max_tokens": 10}, 4) == 6
    assert remaining_tokens(CHAT, {"max_completion_tokens": 10, "max_tokens": 99}, 4) == 6
    assert remaining_tokens(CHAT, {}, 4) is None  # the model's context is the limit
    assert remaining_tokens(COMPLETION_PATH, {}, 4) == 12  # a completion's default is 16 tokens


def test_a_token_exact_continuation_is_a_completion_of_the_prompt_and_generated_ids():
    answer = read_answer(
        chat_chunk(role=True, prompt_ids=[1, 2]) + chat_chunk("a", ids=[7]) + chat_chunk(" b", ids=[8])
    )
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}
    payload |= {"stop": ["\n"], "seed": 3, "stream": True, "tools": None}
    path, body = continuation(CHAT, payload, answer, exact=True)
    assert path == COMPLETION_PATH
    assert body == {
        "model": "m",
        "prompt": [1, 2, 7, 8],
        "max_tokens": 3,
        "temperature": 0,
        "stop": ["\n"],
        "seed": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


def test_a_chat_without_ids_continues_its_final_assistant_message():
    answer = read_answer(chat_chunk(role=True) + chat_chunk("Hel") + chat_chunk("lo"))
    messages = [{"role": "user", "content": "hi"}]
    payload = {"model": "m", "messages": messages, "max_completion_tokens": 9, "top_p": 0.5}
    path, body = continuation(CHAT, payload, answer, exact=False)
    assert path == CHAT
    assert body["messages"] == [*messages, {"role": "assistant", "content": "Hello"}]
    assert (body["continue_final_message"], body["add_generation_prompt"]) == (True, False)
    assert (body["max_completion_tokens"], body["top_p"], body["stream"]) == (7, 0.5, True)
    assert messages == [{"role": "user", "content": "hi"}]  # the client's request is left as it was


def test_a_completion_without_ids_continues_from_its_prompt_and_text():
    answer = read_answer(completion_chunk(" one") + completion_chunk(" two"))
    path, body = continuation(COMPLETION_PATH, {"model": "m", "prompt": ["Count:"]}, answer, exact=False)
    assert (path, body["prompt"], body["max_tokens"]) == (COMPLETION_PATH, "Count: one two", 14)


def splice(first: bytes, *, chat: bool = True, pass_usage: bool = True, client_ids: bool = False):
    transcript = Transcript(chat, client_ids, asked_ids=not client_ids)
    transcript.kept.append(first)
    transcript.read()
    return transcript, transcript.reader(pass_usage)


def parsed(raw: bytes) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in raw.decode().split("\n\n") if line]


def test_a_token_exact_leg_reaches_a_chat_client_as_chat_deltas_of_the_first_answer():
    first = chat_chunk(role=True, prompt_ids=[1, 2, 3]) + chat_chunk("a", ids=[7]) + chat_chunk(" b", ids=[8])
    transcript, reader = splice(first)
    leg = completion_chunk(" c", ids=[9], prompt_ids=[1, 2, 3, 7, 8]) + completion_chunk(" d", ids=[4], finish="length")
    leg += usage_chunk(5, 2) + b"data: [DONE]\n\n"
    # Split anywhere: events are rewritten only once whole.
    out = reader.feed(leg[:50]) + reader.feed(leg[50:-3]) + reader.feed(leg[-3:]) + reader.finish()
    events = parsed(out)
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"content": " c"}, {"content": " d"}]
    assert all((e["id"], e["created"], e["object"]) == ("chatcmpl-1", 7, "chat.completion.chunk") for e in events[:3])
    assert events[1]["choices"][0]["finish_reason"] == "length"
    assert "token_ids" not in json.dumps(events)  # the router asked for them, not the client
    # The client's prompt once (3 ids), and the tokens of both legs.
    assert events[2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert events[3] == "[DONE]"
    assert reader.usage() == (3, 4)
    assert transcript.reprocessed == 5
    assert transcript.answer.token_ids == [7, 8, 9, 4] and transcript.answer.prompt_ids == [1, 2, 3]


def test_a_chat_leg_sends_no_second_role_and_drops_usage_the_client_did_not_ask_for():
    _, reader = splice(chat_chunk(role=True) + chat_chunk("Hi"), pass_usage=False)
    leg = chat_chunk(role=True) + chat_chunk(" there", finish="stop")
    leg += event(
        {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": []}
        | {"usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}}
    )
    events = parsed(reader.feed(leg))
    assert len(events) == 1 and events[0]["choices"][0]["delta"] == {"content": " there"}
    assert "usage" not in events[0]
    # Without ids the client's prompt is this leg's less the one token re-read from the first.
    assert reader.usage() == (11, 2)


def test_token_ids_the_client_asked_for_stay_in_its_events():
    _, reader = splice(
        completion_chunk(" a", ids=[1], prompt_ids=[5], ident="c", created=1), chat=False, client_ids=True
    )
    events = parsed(reader.feed(completion_chunk(" b", ids=[2])))
    assert events[0]["choices"][0] == {
        "index": 0,
        "text": " b",
        "logprobs": None,
        "finish_reason": None,
        "token_ids": [2],
    }
    assert (events[0]["id"], events[0]["created"]) == ("c", 1)


def test_the_first_leg_keeps_whole_events_and_strips_ids_the_router_asked_for():
    transcript = Transcript(chat=True, client_ids=False, asked_ids=True)
    reader = transcript.reader(pass_usage=True)
    whole = chat_chunk("a", ids=[7], prompt_ids=[1, 2])
    sent = reader.feed(whole[:20]) + reader.feed(whole[20:])
    assert sent and b"token_ids" not in sent and json.loads(sent[6:])["choices"][0]["delta"] == {"content": "a"}
    assert b"".join(transcript.kept) == whole  # kept as the engine sent it, ids and all


def test_the_ids_of_an_event_with_no_text_yet_are_kept_for_a_token_exact_continuation():
    # A detokenizer holds back the first bytes of a character made of several tokens: an event with ids, no text.
    raw = chat_chunk(role=True, prompt_ids=[1]) + chat_chunk("", ids=[200]) + chat_chunk("é", ids=[201])
    answer = read_answer(raw)
    assert answer.token_ids == [200, 201] and answer.text == ["é"] and answer.produced == 2 and answer.exact()


def test_a_chat_with_no_text_yet_is_asked_again_rather_than_continued_from_an_empty_message():
    answer = read_answer(chat_chunk(role=True) + chat_chunk(""))
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
    path, body = continuation(CHAT, payload, answer, exact=False)
    assert body["messages"] == payload["messages"] and "continue_final_message" not in body


def test_vllms_empty_prompt_text_goes_with_the_ids_the_router_asked_for():
    transcript = Transcript(chat=True, client_ids=False, asked_ids=True)
    first = event({"id": "c", "choices": [], "prompt_token_ids": [1, 2], "prompt_text": None})
    assert json.loads(transcript.reader(pass_usage=True).feed(first)[6:]) == {"id": "c", "choices": []}


def test_tokens_whose_text_was_held_back_are_made_again_not_continued_from():
    raw = chat_chunk(role=True, prompt_ids=[1]) + chat_chunk("a", ids=[7]) + chat_chunk("", ids=[200])
    answer = read_answer(raw)
    assert answer.token_ids == [7, 200] and answer.produced == 1 and answer.exact()
    _, body = continuation(CHAT, {"model": "m", "messages": [], "max_tokens": 5}, answer, exact=True)
    assert (body["prompt"], body["max_tokens"]) == ([1, 7], 4)


def test_a_client_that_asked_for_ids_gets_the_ids_made_again_only_once():
    first = completion_chunk(" a", ids=[7], prompt_ids=[1]) + completion_chunk("", ids=[200])
    transcript, reader = splice(first, chat=False, client_ids=True)
    events = parsed(reader.feed(completion_chunk(" é", ids=[200, 201]) + completion_chunk(" b", ids=[9])))
    assert [e["choices"][0]["token_ids"] for e in events] == [[201], [9]]
    assert [e["choices"][0]["text"] for e in events] == [" é", " b"]
    assert transcript.answer.token_ids == [7, 200, 201, 9]


# vLLM's own bytes: a chunk as pydantic writes it (compact), and the error event of a GenerationError (json.dumps).
VLLM_ABORT = b'data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"content":" x"},"finish_reason":"abort"}]}\n\n'
VLLM_ERROR = (
    b'data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"content":" y"},"finish_reason":null}]}\n\n'
    b'data: {"error": {"message": "KV load failed", "type": "InternalServerError", "param": null, "code": 500}}\n\n'
)


@pytest.mark.parametrize("chunk", [VLLM_ABORT, VLLM_ERROR, chat_chunk(finish="abort"), chat_chunk(finish="error")])
def test_an_engines_unfinished_end_is_a_break(chunk):
    with pytest.raises(EngineEndedUnfinished):
        check_finished_well(chunk)


@pytest.mark.parametrize(
    "chunk",
    [
        chat_chunk(finish="stop") + chat_chunk(finish="length"),
        chat_chunk('the "error" and "abort" words, quoted in the text'),
        chat_chunk('"finish_reason": "abort"'),  # text that looks like the field is escaped in JSON
        event({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}),
    ],
)
def test_a_well_finished_or_ongoing_answer_is_no_break(chunk):
    check_finished_well(chunk)


@pytest.mark.parametrize("end", ["\n", "\r\n"], ids=["lf", "crlf"])
def test_each_events_data_is_read_whatever_its_lines(end):
    raw = end.join(
        [
            'data: {"a":1}', "",  # the engine's usual event: one line
            ": keep-alive", "",  # a comment: no data
            "event: message", 'data:{"b":2}', "",  # another field, and no space after the colon
            'data: {"c":', "data: 3}", "",  # data over two lines
            "data: [DONE]", "", "",
        ]
    ).encode()  # fmt: skip
    assert events(raw) == [b'{"a":1}', b'{"b":2}', b'{"c":\n3}', b"[DONE]"]


@pytest.mark.parametrize(
    ("raw", "found"),
    [
        (b'data: {"a":1}\n\ndata: {"b":"x\\ny"}\n\ndata: [DONE]\n\n', [b'{"a":1}', b'{"b":"x\\ny"}', b"[DONE]"]),
        # Every event begins "data: ", but one has a second line: read line by line.
        (b'data: {"a":1}\n\ndata: {"c":\ndata: 3}\n\n', [b'{"a":1}', b'{"c":\n3}']),
        (b'data: {"a":1}\n\n: ping\n\ndata: {"b":2}\n\n', [b'{"a":1}', b'{"b":2}']),
    ],
    ids=["one line each", "two lines in one", "a comment between"],
)
def test_one_line_events_are_split_at_once_and_any_other_read_line_by_line(raw, found):
    assert events(raw) == found
