"""Prefix affinity keys: requests whose prompts start alike get the same key, so they can share a replica's KV cache.

The key is a CRC-32 of the first `PREFIX_CHARS` characters of the prompt: the
chat messages' contents in order (system prompt first, then the conversation)
or a completion's prompt. CRC-32 rather than hash(): every router must derive
the same key from the same prompt (str hashes change with each process). A
bounded slice and a C checksum keep it to about a microsecond per request;
anything without a prompt (embeddings, a malformed body the engine will
refuse) has no key and is balanced on load alone.
"""

from __future__ import annotations

import zlib
from typing import Any

PREFIX_CHARS = 2048
# However many messages a chat carries, at most this many are looked at for the prefix.
MAX_MESSAGES = 64


def prefix_affinity(payload: dict[str, Any]) -> int | None:
    """The affinity key of a parsed OpenAI request body, or None when it has no prompt text."""
    messages = payload.get("messages")
    prefix = _chat_prefix(messages) if isinstance(messages, list) else _completion_prefix(payload.get("prompt"))
    if not prefix:
        return None
    return zlib.crc32(prefix[:PREFIX_CHARS].encode("utf-8", "surrogatepass"))


def _chat_prefix(messages: list[Any]) -> str:
    parts: list[str] = []
    size = 0
    for message in messages[:MAX_MESSAGES]:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):  # content parts: only the text ones make a prefix
            content = "".join(
                p["text"] for p in content[:MAX_MESSAGES] if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        if not isinstance(content, str) or not content:
            continue
        parts.append(content[: PREFIX_CHARS - size])  # a huge message is not copied whole
        size += len(content)
        if size >= PREFIX_CHARS:
            break
    return "\x00".join(parts)


def _completion_prefix(prompt: Any) -> str:
    if isinstance(prompt, list) and prompt:
        # A batch of prompts, or one prompt as token ids: the first prompt, or the first ids, make the prefix.
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, int):
            return ",".join(str(t) for t in prompt[: PREFIX_CHARS // 4] if isinstance(t, int))
        if isinstance(first, list):
            return ",".join(str(t) for t in first[: PREFIX_CHARS // 4] if isinstance(t, int))
        return ""
    return prompt if isinstance(prompt, str) else ""
