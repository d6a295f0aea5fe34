"""The three small interfaces between the control plane and the routers.

* endpoint list: the control plane publishes, routers watch (DESIGN invariant 7);
* usage store: routers record last-use stamps, the tick collects them (invariant 4),
  and routers keep a "watching since" mark alive while at least one of them is
  flushing, so the tick can tell "never used while watched" from "unknown"
  (invariant 3);
* activation queue: routers ask for a model to be started, the tick drains it.

Embedded mode keeps all three in this process (InProcessHub); distributed mode
keeps them in Redis (RedisHub). Control-plane methods are synchronous (they run
inside the tick); router methods are coroutines (they run on the router's loop).
`get_hub()` returns the one chosen by settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator

from django.conf import settings

log = logging.getLogger(__name__)

ENDPOINTS_KEY = "llmgw:endpoints"
ENDPOINTS_CHANNEL = "llmgw:endpoints"
USAGE_KEY = "llmgw:usage:last_used"
WATCH_KEY = "llmgw:usage:watching_since"
ACTIVATIONS_KEY = "llmgw:activations"


def fingerprint(table: dict) -> str:
    """A stable digest of an endpoint table (its own fingerprint field excluded)."""
    body = {k: v for k, v in table.items() if k != "fingerprint"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class InProcessHub:
    """Embedded backends: everything in memory, shared by the ticker thread and the router loop."""

    def __init__(self):
        self._lock = threading.Lock()
        self._table: dict | None = None
        self._stamps: dict[str, float] = {}
        self._activations: set[str] = set()
        self._watchers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        # (since, last renewed, ttl) of the routers' "watching" mark; None until a router flushes.
        self._watch: tuple[float, float, float] | None = None
        # Set when there is work for the embedded ticker before its next interval.
        self.wake = threading.Event()

    # -- control plane side -------------------------------------------------
    def publish_endpoints(self, table: dict) -> bool:
        """Publish `table` if its fingerprint changed; return whether it was published."""
        table = {**table, "fingerprint": fingerprint(table)}
        with self._lock:
            if self._table is not None and self._table["fingerprint"] == table["fingerprint"]:
                return False
            self._table = table
            watchers = list(self._watchers)
        for loop, queue in watchers:
            with contextlib.suppress(RuntimeError):  # that router's loop has closed
                loop.call_soon_threadsafe(queue.put_nowait, table)
        return True

    def collect_usage(self) -> dict[str, float]:
        with self._lock:
            return dict(self._stamps)

    def forget_usage(self, replica_ids) -> None:
        with self._lock:
            for rid in replica_ids:
                self._stamps.pop(str(rid), None)

    def drain_activations(self) -> set[str]:
        with self._lock:
            wanted, self._activations = self._activations, set()
        return wanted

    def watching_since(self) -> float | None:
        """Since when routers have recorded usage without a gap (Unix time), or None."""
        with self._lock:
            if self._watch is None:
                return None
            since, renewed, ttl = self._watch
            return since if time.time() - renewed <= ttl else None

    # -- router side ----------------------------------------------------------
    async def read_endpoints(self) -> dict | None:
        with self._lock:
            return self._table

    async def watch_endpoints(self) -> AsyncIterator[dict]:
        """Yield each newly published table, forever."""
        queue: asyncio.Queue = asyncio.Queue()
        entry = (asyncio.get_running_loop(), queue)
        with self._lock:
            self._watchers.append(entry)
        try:
            while True:
                yield await queue.get()
        finally:
            with self._lock:
                self._watchers.remove(entry)

    async def record_usage(self, stamps: dict[str, float]) -> None:
        with self._lock:
            for rid, ts in stamps.items():
                if ts > self._stamps.get(rid, float("-inf")):
                    self._stamps[rid] = ts

    async def request_activation(self, model_name: str) -> None:
        with self._lock:
            self._activations.add(model_name)
        self.wake.set()

    async def keep_watching(self, ttl: float) -> None:
        """Renew the watching mark; a mark not renewed within `ttl` seconds has lapsed."""
        now = time.time()
        with self._lock:
            lapsed = self._watch is None or now - self._watch[1] > self._watch[2]
            self._watch = (now if lapsed else self._watch[0], now, ttl)


class RedisHub:
    """Distributed backends in Redis: a key plus pub/sub, a ZSET, and a set."""

    def __init__(self, url: str):
        import redis
        import redis.asyncio

        self.url = url
        self._sync = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        # Keyed by the loop object itself (weakly): an id() can be reused by a later loop.
        self._async_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._redis_asyncio = redis.asyncio
        self.wake = threading.Event()  # unused in distributed mode: beat sets the cadence

    def _aio(self):
        # One client per event loop: redis.asyncio connections are bound to the loop that made them.
        loop = asyncio.get_running_loop()
        client = self._async_clients.get(loop)
        if client is None:
            client = self._redis_asyncio.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=2)
            self._async_clients[loop] = client
        return client

    # -- control plane side -------------------------------------------------
    def publish_endpoints(self, table: dict) -> bool:
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
        return {member.decode(): score for member, score in self._sync.zrange(USAGE_KEY, 0, -1, withscores=True)}

    def forget_usage(self, replica_ids) -> None:
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
    async def read_endpoints(self) -> dict | None:
        raw = await self._aio().get(ENDPOINTS_KEY)
        return None if raw is None else json.loads(raw)

    async def watch_endpoints(self) -> AsyncIterator[dict]:
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


_hub = None
_hub_lock = threading.Lock()


def get_hub() -> InProcessHub | RedisHub:
    """The process-wide hub for the configured mode."""
    global _hub
    with _hub_lock:
        if _hub is None:
            _hub = RedisHub(settings.REDIS_URL) if settings.REDIS_URL else InProcessHub()
        return _hub


def reset_hub() -> None:
    """Forget the process-wide hub (tests switch modes)."""
    global _hub
    with _hub_lock:
        _hub = None
