"""Client load through every router, recorded request by request.

A thread runs its own event loop with `clients` coroutines, each sending chat
completions in turn to each router for each model, with a short pause between
requests. Every answer is recorded (when sent, when done, status, which
replica answered), so a fault's cost is read off afterwards by time window.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import aiohttp


@dataclass(frozen=True)
class Result:
    """One request: monotonic send and finish times, HTTP status (0: no answer), answering replica."""

    sent: float
    done: float
    router: int
    model: str
    status: int
    replica: str
    error: str


class Load:
    """Keeps `clients` requests in flight across `routers` and `models` until stopped."""

    def __init__(self, routers: list[str], models: list[str], key: str, clients: int = 10, pause: float = 0.1):
        self.routers, self.models, self.key = routers, models, key
        self.clients, self.pause = clients, pause
        self.results: list[Result] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="drill-load", daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._client(session, i) for i in range(self.clients)))

    async def _client(self, session: aiohttp.ClientSession, index: int) -> None:
        turn = index
        headers = {"Authorization": f"Bearer {self.key}"}
        while not self._stop.is_set():
            router = turn % len(self.routers)
            model = self.models[(turn // len(self.routers)) % len(self.models)]
            turn += 1
            body = {"model": model, "messages": [{"role": "user", "content": "drill"}], "max_tokens": 4}
            sent = time.monotonic()
            status, replica, error = 0, "", ""
            try:
                async with session.post(
                    f"{self.routers[router]}/v1/chat/completions", json=body, headers=headers
                ) as response:
                    await response.read()
                    status, replica = response.status, response.headers.get("x-llmgw-replica", "")
                    if status != 200:
                        error = (await response.text())[:200]
            except (TimeoutError, aiohttp.ClientError) as exc:
                error = f"{type(exc).__name__}: {exc}"[:200]
            self.results.append(Result(sent, time.monotonic(), router, model, status, replica, error))
            await asyncio.sleep(self.pause)

    def window(self, start: float, end: float) -> list[Result]:
        """Requests sent within [start, end)."""
        return [r for r in list(self.results) if start <= r.sent < end]
