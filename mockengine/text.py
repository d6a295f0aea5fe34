"""The mock engine's request and answer helpers: OpenAI-shaped errors, prompt text, and embedding vectors."""

from __future__ import annotations

import hashlib
import math

from aiohttp import web

# Where the app keeps its MockEngine (mockengine/generation.py), for handlers outside it (health, sleep).
ENGINE: web.AppKey = web.AppKey("engine")


def openai_error(status: int, message: str, *, kind: str = "invalid_request_error", param=None, code=None):
    """An error response in OpenAI's shape."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status)


class BadRequest(Exception):
    """The request body is not what the endpoint accepts; the text says why."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def words(text: str) -> list[str]:
    return text.split()


def content_text(content) -> str:
    """Text of a chat message's content: a string or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict):
                raise BadRequest("each content part must be an object", "messages")
            if part.get("type") == "text":
                if not isinstance(part.get("text"), str):
                    raise BadRequest("a text content part needs a string “text”", "messages")
                texts.append(part["text"])
        return " ".join(texts)
    raise BadRequest("message content must be a string or a list of parts", "messages")


def embedding_vector(text: str, dimensions: int) -> list[float]:
    """A unit vector derived from a hash of `text`: the same input always gives the same vector."""
    raw = b""
    counter = 0
    while len(raw) < dimensions * 4:
        raw += hashlib.sha256(f"{counter}:{text}".encode()).digest()
        counter += 1
    values = [int.from_bytes(raw[i * 4 : i * 4 + 4], "big") / 2**31 - 1.0 for i in range(dimensions)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [round(v / norm, 6) for v in values]
