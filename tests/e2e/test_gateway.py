"""End to end: the official `openai` SDK, sync and async, against `up --demo` right after its banner.

Models (list and retrieve by alias), chat, a stream with usage, completions,
embeddings, and each typed error: 401, 403 (a model outside the key's scope),
404, 400 and 429 (a key over its requests per minute).
"""

import asyncio
import subprocess
import sys

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.e2e.demo_stack import API_KEY, ROOT, demo_stack

pytestmark = pytest.mark.e2e


@pytest.fixture
def demo(tmp_path):
    with demo_stack(tmp_path) as stack:
        yield stack


def create_key(env, name, *args) -> str:
    out = subprocess.run(
        [sys.executable, "manage.py", "create_api_key", name, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_the_openai_sdk_works_against_the_demo_right_after_its_banner(demo):
    client = OpenAI(base_url=demo["router"] + "/v1", api_key=API_KEY, timeout=90, max_retries=0)

    # Straight after the banner: the nodes may not have reported in yet, and nothing is refused for that.
    reply = client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "hello"}])
    assert "qwen2.5-7b-instruct" in reply.choices[0].message.content

    names = {m.id for m in client.models.list()}
    assert {"llama-3.1-8b-instruct", "qwen2.5-7b-instruct", "bge-m3"} <= names
    by_alias = client.models.retrieve("qwen")
    assert (by_alias.id, by_alias.root) == ("qwen", "qwen2.5-7b-instruct")  # as listed: the alias, and its model

    chunks = list(
        client.chat.completions.create(
            model="llama3",
            messages=[{"role": "user", "content": "stream please"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "llama-3.1-8b-instruct" in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0

    completion = client.completions.create(model="llama3", prompt="once upon a time", max_tokens=5)
    assert completion.choices[0].text and completion.usage.prompt_tokens > 0
    embedding = client.embeddings.create(model="embeddings", input="hello")
    assert len(embedding.data[0].embedding) > 0

    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=demo["router"] + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}])

    scoped = create_key(demo["env"], "scoped", "--models", "qwen")
    scoped_client = OpenAI(base_url=demo["router"] + "/v1", api_key=scoped, timeout=30, max_retries=0)
    assert sorted(m.id for m in scoped_client.models.list()) == ["qwen", "qwen2.5-7b-instruct"]
    with pytest.raises(openai.PermissionDeniedError):
        scoped_client.chat.completions.create(model="llama3", messages=[{"role": "user", "content": "hi"}])

    limited = create_key(demo["env"], "limited", "--rpm", "1")
    limited_client = OpenAI(base_url=demo["router"] + "/v1", api_key=limited, timeout=30, max_retries=0)
    limited_client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "one"}])
    with pytest.raises(openai.RateLimitError) as refused:
        limited_client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "two"}])
    assert refused.value.response.headers["x-ratelimit-limit-requests"] == "1"

    async def async_calls():
        async with AsyncOpenAI(base_url=demo["router"] + "/v1", api_key=API_KEY, timeout=60, max_retries=0) as aio:
            answer = await aio.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "async"}])
            stream = await aio.chat.completions.create(
                model="qwen", messages=[{"role": "user", "content": "async stream"}], stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            return answer.choices[0].message.content, text

    answer, streamed = asyncio.run(async_calls())
    assert "qwen2.5-7b-instruct" in answer and "qwen2.5-7b-instruct" in streamed
