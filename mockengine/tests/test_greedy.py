"""The mock engine's greedy mode (mockengine/greedy.py), served in-process by aiohttp's test server on 127.0.0.1:
answers that continue exactly, vLLM's `return_token_ids` shapes, the 400s, the default mode left alone; and
`--exit-after-tokens`, run as a real subprocess that dies mid-stream."""

import asyncio
import json
import subprocess
import sys

import httpx
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from mockengine.greedy import CONTEXT_TOKENS, DEFAULT_MAX_TOKENS, VOCAB, next_words, token_id
from mockengine.lora import MockLoRA
from mockengine.prefix_cache import MockPrefixCache
from mockengine.server import create_app, parse_args
from mockengine.tests.test_server import PROJECT, start_engine
from mockengine.text import ENGINE

MODEL = "mock-small"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
STORY = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me a story"}]
# create_app keys its application with plain strings (mockengine/server.py), which aiohttp warns about when served
# in-process: noise here.


@pytest_asyncio.fixture
async def client():
    async with TestClient(TestServer(create_app(MODEL, greedy=True))) as test_client:
        yield test_client


async def post(client, path: str, **body) -> dict:
    response = await client.post(path, json={"model": MODEL, **body})
    assert response.status == 200, await response.text()
    return await response.json()


async def stream(client, path: str, **body) -> list:
    """The events of a streamed answer, [DONE] last."""
    response = await client.post(path, json={"model": MODEL, "stream": True, **body})
    assert response.status == 200, await response.text()
    events = []
    for block in (await response.text()).split("\n\n"):
        if block:
            payload = block.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def token_chunks(events: list) -> list[dict]:
    """The choices of the chunks that carry a token (neither role, finish, usage nor [DONE])."""
    choices = [e["choices"][0] for e in events if e != "[DONE]" and e["choices"]]
    return [c for c in choices if c["finish_reason"] is None and "role" not in c.get("delta", {})]


def piece(choice: dict) -> str:
    return choice["delta"]["content"] if "delta" in choice else choice["text"]


def test_the_vocabulary_is_512_distinct_lowercase_words_with_distinct_ids():
    assert len(VOCAB) == len(set(VOCAB)) == 512
    assert all(word.isalpha() and word.islower() and len(word) <= 4 for word in VOCAB)
    assert len({token_id(word) for word in VOCAB}) == 512
    assert token_id("hello") == 907060870  # crc32, 31 bits: stable across processes and versions


def test_each_token_depends_only_on_the_context_before_it():
    context = [token_id(w) for w in ("once", "upon", "a", "time")]
    answer = next_words(context, 20)
    assert next_words(context, 20) == answer and next_words(context, 5) == answer[:5]
    assert next_words(context + [token_id(w) for w in answer[:7]], 13) == answer[7:]
    assert next_words(context[1:], 20) != answer


@pytest.mark.asyncio
async def test_the_same_request_gives_the_same_answer(client):
    first, second, other = [await post(client, CHAT, messages=m) for m in (STORY, STORY, STORY[1:])]
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    assert first["choices"][0]["message"]["content"] != other["choices"][0]["message"]["content"]


@pytest.mark.asyncio
async def test_a_completion_prompted_with_its_ids_and_the_first_tokens_gives_exactly_the_rest(client):
    events = await stream(client, COMPLETIONS, prompt="the quick brown fox", max_tokens=20, return_token_ids=True)
    chunks = token_chunks(events)
    assert len(chunks) == 20
    prompt, generated = chunks[0]["prompt_token_ids"], [c["token_ids"][0] for c in chunks]
    texts = [c["text"] for c in chunks]
    rest = await post(client, COMPLETIONS, prompt=prompt + generated[:7], max_tokens=13, return_token_ids=True)
    choice = rest["choices"][0]
    assert choice["token_ids"] == generated[7:] and choice["text"] == "".join(texts[7:])
    assert choice["prompt_token_ids"] == prompt + generated[:7] and choice["finish_reason"] == "length"
    # The same text prompt continues the same way: a word is its id wherever it comes from.
    again = await post(client, COMPLETIONS, prompt="the quick brown fox" + "".join(texts[:7]), max_tokens=13)
    assert again["choices"][0]["text"] == "".join(texts[7:])


@pytest.mark.asyncio
async def test_a_chat_continuing_its_partial_answer_as_the_final_message_gives_exactly_the_rest(client):
    events = await stream(client, CHAT, messages=STORY, max_tokens=20, return_token_ids=True)
    chunks = token_chunks(events)
    texts, generated = [c["delta"]["content"] for c in chunks], [c["token_ids"][0] for c in chunks]
    assert len(texts) == 20 and not texts[0].startswith(" ") and all(t.startswith(" ") for t in texts[1:])
    partial = {"role": "assistant", "content": "".join(texts[:7])}
    for flags in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False}):
        body = {"messages": [*STORY, partial], "max_tokens": 13, "return_token_ids": True, **flags}
        whole = await post(client, CHAT, **body)
        assert whole["choices"][0]["message"]["content"] == "".join(texts[7:])
        assert whole["choices"][0]["token_ids"] == generated[7:]
        assert whole["prompt_token_ids"] == events[0]["prompt_token_ids"] + generated[:7]
        rest = token_chunks(await stream(client, CHAT, **body))
        assert [c["delta"]["content"] for c in rest] == texts[7:] and [c["token_ids"][0] for c in rest] == generated[7:]
    # An empty final message continues nothing: the answer starts bare, as a fresh one.
    empty = await post(
        client, CHAT, messages=[*STORY, {"role": "assistant", "content": ""}], continue_final_message=True
    )
    assert not empty["choices"][0]["message"]["content"].startswith(" ")


@pytest.mark.asyncio
async def test_streamed_chat_ids_are_vllms_prompt_ids_on_the_role_chunk_and_each_chunks_own(client):
    events = await stream(client, CHAT, messages=STORY, max_tokens=4, return_token_ids=True)
    role, *tokens, finish, done = events
    assert done == "[DONE]"
    prompt = [token_id(w) for w in ("<system>", "be", "brief", "<end>", "<user>", "tell", "me", "a", "story", "<end>")]
    assert role["prompt_token_ids"] == prompt + [token_id("<assistant>")]
    assert "token_ids" not in role["choices"][0] and role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("prompt_token_ids" not in e for e in [*tokens, finish])
    for chunk in tokens:
        choice = chunk["choices"][0]
        assert choice["token_ids"] == [token_id(choice["delta"]["content"].strip())]
    assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["token_ids"] == []


@pytest.mark.asyncio
async def test_streamed_completion_ids_are_vllms_prompt_ids_in_the_first_choice_and_each_chunks_own(client):
    events = await stream(client, COMPLETIONS, prompt="x y", max_tokens=3, return_token_ids=True)
    first, second, third, finish, done = events
    assert first["choices"][0]["prompt_token_ids"] == [token_id("x"), token_id("y")]
    assert [e["choices"][0]["prompt_token_ids"] for e in (second, third, finish)] == [None] * 3
    for chunk in (first, second, third):
        choice = chunk["choices"][0]
        assert choice["text"].startswith(" ") and choice["token_ids"] == [token_id(choice["text"][1:])]
    assert all("prompt_token_ids" not in e for e in events[:-1])  # never at the top of a completion chunk


@pytest.mark.asyncio
async def test_whole_answers_carry_the_ids_where_vllm_puts_them(client):
    chat = await post(client, CHAT, messages=STORY, max_tokens=5, return_token_ids=True)
    assert len(chat["prompt_token_ids"]) == 11 and "prompt_token_ids" not in chat["choices"][0]
    words = chat["choices"][0]["message"]["content"].split()
    assert chat["choices"][0]["token_ids"] == [token_id(w) for w in words]
    completion = await post(client, COMPLETIONS, prompt="x y", max_tokens=5, return_token_ids=True)
    choice = completion["choices"][0]
    assert "prompt_token_ids" not in completion and choice["prompt_token_ids"] == [token_id("x"), token_id("y")]
    assert choice["token_ids"] == [token_id(w) for w in choice["text"].split()]
    # Not asked for: no ids anywhere.
    plain = await post(client, COMPLETIONS, prompt="x y", max_tokens=5)
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


@pytest.mark.asyncio
async def test_usage_counts_the_context_and_exactly_the_limit_or_what_the_context_leaves(client):
    chat = await post(client, CHAT, messages=STORY)
    # Each message: its role, its words, <end>; then <assistant>. Without a limit, to the end of the context.
    rest = CONTEXT_TOKENS - 11
    assert chat["usage"] == {"prompt_tokens": 11, "completion_tokens": rest, "total_tokens": CONTEXT_TOKENS}
    assert chat["choices"][0]["finish_reason"] == "length"
    assert len(chat["choices"][0]["message"]["content"].split()) == rest
    # A completion naming no limit gets 16 tokens; one whose limit is null runs to the end of the context.
    short = await post(client, COMPLETIONS, prompt="a b c")
    assert short["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS
    long = await post(client, COMPLETIONS, prompt="a b c", max_tokens=None)
    assert long["usage"]["completion_tokens"] == CONTEXT_TOKENS - 3
    full = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": [1] * CONTEXT_TOKENS, "max_tokens": None})
    assert full.status == 400 and "leave no room" in (await full.json())["error"]["message"]
    events = await stream(client, COMPLETIONS, prompt="a b c", max_tokens=4, stream_options={"include_usage": True})
    assert events[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    capped = await post(client, COMPLETIONS, prompt=[5, 6], max_completion_tokens=2)
    assert capped["usage"]["prompt_tokens"] == 2 and len(capped["choices"][0]["text"].split()) == 2
    engine = client.server.app[ENGINE]
    counted = (engine.prompt_tokens_total, engine.generation_tokens_total)
    assert counted == (11 + 3 + 3 + 3 + 2, rest + 16 + CONTEXT_TOKENS - 3 + 4 + 2)


@pytest.mark.parametrize(
    ("path", "body", "problem"),
    [
        (CHAT, {"messages": STORY, "continue_final_message": True}, "assistant"),
        (CHAT, {"messages": STORY, "continue_final_message": True, "add_generation_prompt": True}, "Cannot set both"),
        (CHAT, {"messages": STORY, "continue_final_message": "yes"}, "continue_final_message"),
        (CHAT, {"messages": STORY, "return_token_ids": 1}, "return_token_ids"),
        (COMPLETIONS, {"prompt": [1, -2]}, "prompt token ids"),
        (COMPLETIONS, {"prompt": [1, 2.5]}, "prompt token ids"),
        (COMPLETIONS, {"prompt": [True, 2]}, "prompt token ids"),
        (COMPLETIONS, {"prompt": [1, "two"]}, "prompt token ids"),
        (COMPLETIONS, {"prompt": [2**31]}, "prompt token ids"),
    ],
)
@pytest.mark.asyncio
async def test_bad_greedy_requests_are_400_in_openai_error_shape(client, path, body, problem):
    response = await client.post(path, json={"model": MODEL, **body})
    assert response.status == 400
    error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"} and problem in error["message"]
    if problem == "Cannot set both":  # vLLM's words, naming both fields
        assert "`continue_final_message`" in error["message"] and "`add_generation_prompt`" in error["message"]


@pytest.mark.asyncio
async def test_without_greedy_the_answers_are_the_default_ones_and_ids_are_ignored():
    async with TestClient(TestServer(create_app(MODEL))) as plain:
        body = {"messages": STORY, "return_token_ids": True, "continue_final_message": True}
        chat = await post(plain, CHAT, **body)
        assert chat["choices"][0]["message"]["content"] == f"mock reply from {MODEL}: tell me a story"
        assert "prompt_token_ids" not in chat and "token_ids" not in chat["choices"][0]
        assert chat["usage"] == {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14}
        events = await stream(plain, COMPLETIONS, prompt="x y", return_token_ids=True)
        assert "".join(c["text"] for c in token_chunks(events)) == f"mock reply from {MODEL}: x y"
        assert all("token_ids" not in e["choices"][0] for e in events[:-1])
        # A prompt of ids is greedy mode's only.
        assert (await plain.post(COMPLETIONS, json={"model": MODEL, "prompt": [1, 2]})).status == 400


@pytest.mark.asyncio
async def test_greedy_answers_go_through_adapters_the_prefix_cache_and_a_sleep_abort():
    lora = MockLoRA(enabled=True)
    lora.held["my-adapter"] = "org/adapter"
    app = create_app(MODEL, 5, dev_mode=True, lora=lora, prefix_cache=MockPrefixCache(4096), greedy=True)
    async with TestClient(TestServer(app)) as client:
        long = [{"role": "user", "content": " ".join(f"w{i}" for i in range(40))}]
        base = await post(client, CHAT, messages=long, max_tokens=3)
        adapted = await post(client, CHAT, messages=long, max_tokens=3, model="my-adapter")
        assert adapted["model"] == "my-adapter" and adapted["choices"] == base["choices"]
        # 43 context tokens: two full blocks of 16, found the second time.
        assert app[ENGINE].prefix_cache.hits == 32
        response = await client.post(CHAT, json={"model": MODEL, "messages": long, "max_tokens": 400, "stream": True,
                                                 "return_token_ids": True})  # fmt: skip
        await response.content.readline()
        await asyncio.sleep(0.05)
        assert (await client.post("/sleep")).status == 200
        events = [json.loads(line[6:]) for line in (await response.text()).splitlines() if line[6:7] == "{"]
        assert events[-1]["choices"][0]["finish_reason"] == "abort" and 0 < len(events) < 400


def test_exit_after_tokens_kills_the_engine_right_after_the_nth_token_over_all_answers():
    proc, base = start_engine("--greedy", "--exit-after-tokens", "5")
    try:
        with httpx.Client(base_url=base, timeout=5, trust_env=False) as http:
            # Three tokens in a whole answer, then a stream cut after two more.
            body = {"model": MODEL, "prompt": "a b", "max_tokens": 3}
            assert http.post(COMPLETIONS, json=body).status_code == 200
            lines = []
            body = {"model": MODEL, "messages": STORY, "max_tokens": 20, "stream": True}
            # The body is cut short: httpx says so once it has read what came.
            with pytest.raises(httpx.HTTPError), http.stream("POST", CHAT, json=body) as response:
                lines.extend(response.iter_lines())
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert "data: [DONE]" not in lines and len(events) == 3  # the role chunk and two tokens
        assert [e["choices"][0]["finish_reason"] for e in events] == [None] * 3
        assert proc.wait(5) == 1
        assert "mock engine: exiting after 5 tokens (--exit-after-tokens)" in proc.stdout.read().decode()
    finally:
        proc.kill()
        proc.wait(5)


def test_exit_after_exactly_five_streamed_tokens_cuts_the_stream_there():
    proc, base = start_engine("--greedy", "--exit-after-tokens", "5")
    try:
        lines = []
        body = {"model": MODEL, "prompt": "a b", "max_tokens": 20, "stream": True, "return_token_ids": True}
        with (
            httpx.Client(base_url=base, timeout=5, trust_env=False) as http,
            pytest.raises(httpx.HTTPError),
            http.stream("POST", COMPLETIONS, json=body) as response,
        ):
            lines.extend(response.iter_lines())
        chunks = [json.loads(line[6:])["choices"][0] for line in lines if line.startswith("data: ")]
        # Five token chunks and nothing after: no finish chunk, no [DONE].
        assert len(chunks) == 5 and all(len(c["token_ids"]) == 1 and c["finish_reason"] is None for c in chunks)
        assert "data: [DONE]" not in lines and chunks[0]["prompt_token_ids"] == [token_id("a"), token_id("b")]
        assert proc.wait(5) == 1
    finally:
        proc.kill()
        proc.wait(5)


def test_exit_after_no_token_ends_a_chat_stream_after_its_role_chunk():
    proc, base = start_engine("--greedy", "--exit-after-tokens", "0")
    try:
        lines = []
        body = {"model": MODEL, "messages": STORY, "max_tokens": 20, "stream": True}
        with (
            httpx.Client(base_url=base, timeout=5, trust_env=False) as http,
            pytest.raises(httpx.HTTPError),
            http.stream("POST", CHAT, json=body) as response,
        ):
            lines.extend(response.iter_lines())
        (event,) = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert event["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert proc.wait(5) == 1
    finally:
        proc.kill()
        proc.wait(5)


@pytest.mark.parametrize("value", ["-1", "-3", "x", "1.5"])
def test_exit_after_tokens_must_be_a_whole_number(value, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(["--port", "8000", "--model", "m", "--exit-after-tokens", value])
    assert exited.value.code == 2
    assert "--exit-after-tokens" in capsys.readouterr().err


def test_the_flags_reach_the_engine_and_default_to_off():
    args = parse_args(["--port", "8000", "--model", "m", "--greedy", "--exit-after-tokens", "40"])
    assert args.greedy is True and args.exit_after_tokens == 40
    args = parse_args(["--port", "8000", "--model", "m"])
    assert args.greedy is False and args.exit_after_tokens is None
    result = subprocess.run(
        [sys.executable, "-m", "mockengine", "--port", "8000", "--model", "m", "--exit-after-tokens", "-1"],
        cwd=PROJECT, capture_output=True, text=True, timeout=10,
    )  # fmt: skip
    assert result.returncode == 2 and "expected a whole number of 0 or more, got -1" in result.stderr
