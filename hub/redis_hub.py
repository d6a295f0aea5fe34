"""The distributed hub in Redis: a key plus pub/sub for the endpoint table, a ZSET of
last-use stamps, a key with a TTL for the watch mark, and a set of activations."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator, Iterable
from typing import cast

import redis
import redis.asyncio

from .contracts import EndpointTable
from .fingerprint import fingerprint

log = logging.getLogger(__name__)

ENDPOINTS_KEY = "llmgw:endpoints"
ENDPOINTS_CHANNEL = "llmgw:endpoints"
USAGE_KEY = "llmgw:usage:last_used"
WATCH_KEY = "llmgw:usage:watching_since"
ACTIVATIONS_KEY = "llmgw:activations"


class RedisHub:
    """Distributed backends in Redis; the control plane's calls are synchronous, the router's async."""

    def __init__(self, url: str):
        self.url = url
        self._sync = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        # Keyed by the loop object itself (weakly): an id() can be reused by a later loop.
        self._async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, redis.asyncio.Redis] = (
            weakref.WeakKeyDictionary()
        )

    def _aio(self) -> redis.asyncio.Redis:
        # One client per event loop: redis.asyncio connections are bound to the loop that made them.
        loop = asyncio.get_running_loop()
        client = self._async_clients.get(loop)
        if client is None:
            client = redis.asyncio.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=2)
            self._async_clients[loop] = client
        return client

    # -- control plane side -------------------------------------------------
    def publish_endpoints(self, table: EndpointTable) -> bool:
        table = {**table, "fingerprint": fingerprint(table)}
        current = self._sync.get(ENDPOINTS_KEY)
        if current is not None and json.loads(current).get("fingerprint") == table["fingerprint"]:
            return False
        payload = json.dumps(table, sort_keys=True)
        pipe = self._sync.pipeline(transaction=True)
        pipe.set(ENDPOINTS_KEY, payload)
        pipe.publish(ENDPOINTS_CHANNEL, payload)
        pipe.execute()
        return True

    def collect_usage(self) -> dict[str, float]:
        # redis-py's sync client is typed as possibly awaitable; it is not.
        rows = cast(list[tuple[bytes, float]], self._sync.zrange(USAGE_KEY, 0, -1, withscores=True))
        return {member.decode(): score for member, score in rows}

    def forget_usage(self, replica_ids: Iterable[str | int]) -> None:
        ids = [str(r) for r in replica_ids]
        if ids:
            self._sync.zrem(USAGE_KEY, *ids)

    def drain_activations(self) -> set[str]:
        pipe = self._sync.pipeline(transaction=True)
        pipe.smembers(ACTIVATIONS_KEY)
        pipe.delete(ACTIVATIONS_KEY)
        members, _ = pipe.execute()
        return {m.decode() for m in members}

    def watching_since(self) -> float | None:
        raw = self._sync.get(WATCH_KEY)
        return None if raw is None else float(raw)

    # -- router side ----------------------------------------------------------
    async def read_endpoints(self) -> EndpointTable | None:
        raw = await self._aio().get(ENDPOINTS_KEY)
        return None if raw is None else json.loads(raw)

    async def watch_endpoints(self) -> AsyncIterator[EndpointTable]:
        """Yield each table published on the channel, reconnecting after failures."""
        while True:
            pubsub = self._aio().pubsub()
            try:
                await pubsub.subscribe(ENDPOINTS_CHANNEL)
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        yield json.loads(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down: the poll backstop covers the gap
                log.warning("endpoint subscription failed, retrying: %s", exc)
                await asyncio.sleep(1)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def record_usage(self, stamps: dict[str, float]) -> None:
        if stamps:
            # GT: newest wins, so routers flushing out of order never move a stamp back.
            await self._aio().zadd(USAGE_KEY, stamps, gt=True)

    async def request_activation(self, model_name: str) -> None:
        await self._aio().sadd(ACTIVATIONS_KEY, model_name)

    async def keep_watching(self, ttl: float) -> None:
        # Any router renews the one mark; it starts afresh only after every router stopped for `ttl`.
        pipe = self._aio().pipeline(transaction=True)
        pipe.set(WATCH_KEY, repr(time.time()), nx=True, px=int(ttl * 1000))
        pipe.pexpire(WATCH_KEY, int(ttl * 1000))
        await pipe.execute()
