"""Streams for the drill's mid-stream faults: many chat streams at once, each read to its end, event by event.

Each result says what the client saw: the text, the finish reasons, an error
event if one came, whether `[DONE]` ended it, and the longest pause between
two events (what a continuation on another replica costs the client).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class StreamResult:
    """What one client saw of its stream."""

    status: int = 0
    text: str = ""
    finishes: list[str] = field(default_factory=list)
    error: str = ""
    done: bool = False
    longest_gap: float = 0.0

    @property
    def whole(self) -> bool:
        """Ended as an uninterrupted answer ends: 200, one finish reason, no error event, [DONE]."""
        return self.status == 200 and len(self.finishes) == 1 and not self.error and self.done


def prompt(index: int) -> str:
    return f"tell the drill story number {index}"


async def _stream(session: aiohttp.ClientSession, url: str, key: str, body: dict) -> StreamResult:
    result = StreamResult()
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
            result.status = response.status
            last = time.monotonic()
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                now = time.monotonic()
                result.longest_gap, last = max(result.longest_gap, now - last), now
                data = line[6:].strip()
                if data == b"[DONE]":
                    result.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    result.error = event["error"].get("message", str(event["error"]))
                for choice in event.get("choices") or ():
                    result.text += choice["delta"].get("content") or ""
                    if choice.get("finish_reason"):
                        result.finishes.append(choice["finish_reason"])
    except (TimeoutError, aiohttp.ClientError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def streams(routers: list[str], model: str, key: str, count: int, max_tokens: int) -> list[StreamResult]:
    """`count` streams of `model` at once, spread over `routers`, stream i asking for the story of prompt(i)."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        bodies = [
            {"model": model, "messages": [{"role": "user", "content": prompt(i)}], "max_tokens": max_tokens,
             "temperature": 0, "stream": True}
            for i in range(count)
        ]  # fmt: skip
        return list(
            await asyncio.gather(*(_stream(session, routers[i % len(routers)], key, b) for i, b in enumerate(bodies)))
        )


def run_streams(routers: list[str], model: str, key: str, count: int, max_tokens: int) -> list[StreamResult]:
    """`streams` from a thread with no event loop of its own running."""
    return asyncio.run(streams(routers, model, key, count, max_tokens))
