"""Prefix affinity: each turn of a conversation goes where the KV cache of its earlier turns is.

Engines cache a prompt's KV in blocks, each keyed by a hash chained over everything before it (vLLM's prefix
caching, SGLang's radix tree), so a request reuses the cache of any earlier request that began the same way.
The router sees text, not tokens, and chains over it the same way: the prompt is cut per message (its role
and text) and, within a message, into `BLOCK_BYTES` blocks; each block's hash is the CRC-32 of its bytes
continuing from the previous block's. Equal hashes mean prompts equal up to the end of that block, across
requests, processes and routers (a CRC, not hash(): str hashes change with each process).

A `Prefix` is that chain and the length of the conversation's opening: its messages up to the first that is
not a system message, or a completion prompt's first block. The chain's value there, the conversation key, is
the same for every turn of a conversation. The picker (router.picking.picker) remembers which replica each block
was last sent to, and sends a request to the replica that had its longest remembered prefix at least as long
as its opening, else to its conversation key's replica by rendezvous hashing (the same on every router),
while that replica's load stays within the slack of the least loaded. Anything without a prompt (embeddings, a body the engine will refuse) has no prefix and is
balanced on load alone.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any, NamedTuple

# About 128 tokens of English: a few of an engine's blocks (vLLM's hold 16 tokens), small enough that a new
# turn's cached part is nearly all of its earlier turns.
BLOCK_BYTES = 512
# At most this much of a prompt is hashed (128 KiB): past it, prompts that agree so far share their replica.
MAX_BLOCKS = 256
# However many messages (or content parts) a chat carries, at most this many are looked at.
MAX_MESSAGES = 256
OPENING_ROLES = frozenset({"system", "developer"})


class Prefix(NamedTuple):
    """A prompt's chained block hashes (each covers the prompt up to the end of its block), of which the first
    `opening` are the conversation's opening: the last of those is its conversation key."""

    blocks: list[int]
    opening: int

    @property
    def key(self) -> int:
        return self.blocks[self.opening - 1]


def prefix_affinity(payload: dict[str, Any]) -> Prefix | None:
    """The Prefix of a parsed OpenAI request body, or None when it has no prompt text."""
    messages = payload.get("messages")
    if isinstance(messages, list):
        return _chat_prefix(messages)
    text = _completion_text(payload.get("prompt"))
    if not text:
        return None
    return Prefix(_chain(text.encode("utf-8", "surrogatepass"), 0, []), 1)


def _chain(data: bytes, value: int, blocks: list[int]) -> list[int]:
    """Add to `blocks` the chained hashes of `data`'s blocks, starting from `value`; return `blocks`."""
    view = memoryview(data)
    for start in range(0, len(data), BLOCK_BYTES):
        if len(blocks) >= MAX_BLOCKS:
            break
        value = zlib.crc32(view[start : start + BLOCK_BYTES], value)
        blocks.append(value)
    return blocks


def _chat_prefix(messages: list[Any]) -> Prefix | None:
    blocks: list[int] = []
    opening = 0
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
        role = message.get("role")
        role = role if isinstance(role, str) else ""
        # The role ends with a NUL, so no two messages' bytes run into each other the same way twice.
        _chain(f"{role}\x00{content}".encode("utf-8", "surrogatepass"), blocks[-1] if blocks else 0, blocks)
        if not opening and role not in OPENING_ROLES:
            opening = len(blocks)
        if len(blocks) >= MAX_BLOCKS:
            break
    if not blocks:
        return None
    return Prefix(blocks, opening or len(blocks))


def _completion_text(prompt: Any) -> str:
    if isinstance(prompt, list) and prompt:
        # A batch of prompts, or one prompt as token ids: the first prompt, or the first ids, make the prefix.
        first = prompt[0]
        if isinstance(first, str):
            return first
        ids = prompt if isinstance(first, int) else first if isinstance(first, list) else []
        return ",".join(str(t) for t in ids[: MAX_BLOCKS * BLOCK_BYTES // 4] if isinstance(t, int))
    return prompt if isinstance(prompt, str) else ""


class PrefixMemory:
    """Per model, the replica each prompt block was last sent to: where that prefix's KV cache is.

    Bounded: past `limit` blocks for a model, the oldest half is forgotten (older turns' blocks first; a
    lookup walks from a prompt's end, so a conversation is found by its latest turns).
    """

    def __init__(self, limit: int = 65_536) -> None:
        self.limit = limit
        self._sent: dict[str, dict[int, str]] = {}

    def last_replica(self, model: str, prefix: Prefix) -> str | None:
        """The replica the longest remembered prefix of `prefix` was last sent to, or None.

        Only prefixes as long as its opening count: a system prompt many conversations share says nothing of
        which one this is (and every replica holds it soon enough)."""
        sent = self._sent.get(model)
        if sent:
            blocks = prefix.blocks
            for index in range(len(blocks) - 1, prefix.opening - 2, -1):
                replica = sent.get(blocks[index])
                if replica is not None:
                    return replica
        return None

    def remember(self, model: str, prefix: Prefix, replica: str) -> None:
        """`prefix` went to `replica`: each of its blocks is now cached there."""
        sent = self._sent.get(model)
        if sent is None:
            sent = self._sent[model] = {}
        for block in prefix.blocks:
            sent[block] = replica
        if len(sent) > self.limit:
            for block in list(sent)[: len(sent) // 2]:
                del sent[block]

    def keep_only(self, models: Iterable[str]) -> None:
        """Forget the models no longer served."""
        for model in self._sent.keys() - set(models):
            del self._sent[model]
