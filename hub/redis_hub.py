"""The distributed hub in Redis: a key plus pub/sub for the endpoint table, a ZSET of
last-use stamps, a hash of routers' watch marks, a hash of token counters and one of continuation counters, a
ZSET of API keys' last use, a set of activations (`contracts.encode_activation`: a model name, or a JSON object
naming its pools too), and a pub/sub channel of changed API keys.

A router's report is one MULTI round trip: the stamps and keys' last use
(`ZADD GT`, newest wins) and its token counts (`HINCRBY`, one field per hour,
kind, key and model: counters add up across routers; its continuation counts
likewise, per hour, kind and model) first, then its mark renewed by a Lua script (read, keep or restart `since`,
write: atomic, so two flushes of one router cannot interleave). The tick reads
marks then stamps in one MULTI, so a mark it sees renewed vouches for stamps it
also sees; the same MULTI reads and deletes the token and continuation counters and keys' last use,
so each count is taken by exactly one tick, whichever leader runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, cast

import msgspec
import redis
import redis.asyncio

from hub.budgets import Refusal, Reservation
from hub.contracts import (
    Activation,
    ContinuationCounts,
    EndpointTable,
    LimitCount,
    LimitCounts,
    ModelWindow,
    ReplicaTokens,
    RequestRecord,
    RouterMark,
    TokenCounts,
    UsageReport,
    UsageSnapshot,
    checked,
    decode_activation,
    encode_activation,
    hour_of,
)
from hub.fingerprint import fingerprinted
from hub.hash_fields import continuation_fields, parse_continuation_fields, parse_token_fields, token_fields
from hub.redis_budgets import (
    COUNTER_KEY,
    LEDGER_KEYS,
    RESERVE_LUA,
    SETTLE_LUA,
    SWEEP_LUA,
    refusal_of,
    reserve_call,
    settle_call,
    used_of,
)

log = logging.getLogger(__name__)

ASYNC_CONNECTIONS = 64  # a router's connections to Redis at most (per event loop)
ENDPOINTS_KEY = "llmgw:endpoints"
# Pub/sub channels belong to the whole Redis server, not to a database: each name ends in the database's number
# (`channel_of`), so fleets on two databases of one server never hear each other's tables and key changes.
ENDPOINTS_CHANNEL = "llmgw:endpoints"
USAGE_KEY = "llmgw:usage:last_used"
ROUTERS_KEY = "llmgw:routers"
# Per-minute counts of rate-limited keys: a hash per minute, fields "<requests|tokens> <key digest>".
LIMITS_KEY = "llmgw:limits:{minute}"
ACTIVATIONS_KEY = "llmgw:activations"
KEY_CHANGES_CHANNEL = "llmgw:api-key-changes"
TOKENS_KEY = "llmgw:usage:tokens"
KEYS_USED_KEY = "llmgw:usage:keys_last_used"
# Counter fields: hub.hash_fields.
CONTINUATIONS_KEY = "llmgw:usage:continuations"
# Per-request records: a list of batches (one a report, msgpack arrays), taken by the tick; bounded.
RECORDS_KEY = "llmgw:usage:records"
MAX_RECORD_BATCHES = 100_000

# KEYS[1] = the marks hash; ARGV = router id, now, ttl, in-flight JSON, windows JSON (now and ttl as Python float
# reprs).
# `since` is kept while the router's previous mark has not lapsed, else it restarts at now. The value is
# assembled as text rather than with cjson.encode, which would round Unix times to 14 digits.
RENEW_MARK_LUA = """
local now = tonumber(ARGV[2])
local since = ARGV[2]
local previous = redis.call('HGET', KEYS[1], ARGV[1])
if previous then
  local ok, mark = pcall(cjson.decode, previous)
  if ok and type(mark) == 'table' and tonumber(mark.renewed) and tonumber(mark.ttl) and tonumber(mark.since)
     and now - tonumber(mark.renewed) <= tonumber(mark.ttl) then
    since = string.format('%.17g', tonumber(mark.since))
  end
end
redis.call('HSET', KEYS[1], ARGV[1],
  '{"since": ' .. since .. ', "renewed": ' .. ARGV[2] .. ', "ttl": ' .. ARGV[3] .. ', "in_flight": ' .. ARGV[4]
  .. ', "windows": ' .. ARGV[5] .. '}')
return since
"""


_decode_records = msgspec.msgpack.Decoder(list[RequestRecord]).decode
_RESERVE_SHA = hashlib.sha1(RESERVE_LUA.encode()).hexdigest()  # noqa: S324 (Redis names scripts by SHA-1)
_SETTLE_SHA = hashlib.sha1(SETTLE_LUA.encode()).hexdigest()  # noqa: S324


class _StoredMark(msgspec.Struct):
    """A watch mark as RENEW_MARK_LUA writes it in the marks hash (the router id is its field name)."""

    since: float
    renewed: float
    ttl: float
    in_flight: dict[str, int] = {}
    windows: dict[str, ModelWindow] = {}


_decode_mark = msgspec.json.Decoder(_StoredMark).decode


def _parse_mark(router: str, raw: bytes) -> RouterMark:
    """A mark as the Lua script wrote it; ValueError if it is not that shape."""
    try:
        mark = _decode_mark(raw)
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed watch mark of router {router!r}: {raw!r} ({exc})") from None
    return RouterMark(
        router=router,
        since=mark.since,
        renewed=mark.renewed,
        ttl=mark.ttl,
        in_flight=mark.in_flight,
        windows=mark.windows,
    )


class _Fingerprint(msgspec.Struct):
    """Just the fingerprint of a stored table: what a publish compares with."""

    fingerprint: str = ""


def _fingerprint_of(stored: bytes | str) -> str | None:
    """The fingerprint of the stored table, or None when it is unreadable (then it is replaced)."""
    try:
        return msgspec.json.decode(stored, type=_Fingerprint).fingerprint
    except msgspec.DecodeError:
        return None


def channel_of(name: str, database: int) -> str:
    """The pub/sub channel `name` of the fleet whose keys are in `database` (see ENDPOINTS_CHANNEL)."""
    return f"{name}:{database}"


class RedisHub:
    """Distributed backends in Redis; the control plane's calls are synchronous, the router's async."""

    def __init__(self, url: str, clock: Callable[[], float] = time.time) -> None:
        self.url = url
        self._clock = clock
        self._sync = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        database = int(self._sync.connection_pool.connection_kwargs.get("db") or 0)
        self.endpoints_channel = channel_of(ENDPOINTS_CHANNEL, database)
        self.key_changes_channel = channel_of(KEY_CHANGES_CHANNEL, database)
        # Keyed by the loop object itself (weakly): an id() can be reused by a later loop.
        self._async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, redis.asyncio.Redis] = (
            weakref.WeakKeyDictionary()
        )

    def _aio(self) -> redis.asyncio.Redis:
        # One client per event loop: redis.asyncio connections are bound to the loop that made them.
        loop = asyncio.get_running_loop()
        client = self._async_clients.get(loop)
        if client is None:
            # A blocking pool: a burst of requests (each a budget's reservation) waits its turn for one of
            # ASYNC_CONNECTIONS, where the default pool would fail the request with "Too many connections".
            pool = redis.asyncio.BlockingConnectionPool.from_url(
                self.url, max_connections=ASYNC_CONNECTIONS, timeout=5, socket_timeout=5, socket_connect_timeout=2
            )
            client = redis.asyncio.Redis(connection_pool=pool)
            self._async_clients[loop] = client
        return client

    # -- control plane side -------------------------------------------------
    def publish_endpoints(self, table: EndpointTable) -> bool:
        table, payload = fingerprinted(table)
        current = self._sync.get(ENDPOINTS_KEY)
        if current is not None and _fingerprint_of(current) == table.fingerprint:
            return False
        pipe = self._sync.pipeline(transaction=True)
        pipe.set(ENDPOINTS_KEY, payload)
        pipe.publish(self.endpoints_channel, payload)
        pipe.execute()
        return True

    def collect_usage(self) -> UsageSnapshot:
        pipe = self._sync.pipeline(transaction=True)
        self._sweep_budgets(pipe)  # expired reservations are charged before the ledger is taken (its reply first)
        pipe.hgetall(ROUTERS_KEY)  # marks before stamps: see UsageSnapshot
        pipe.zrange(USAGE_KEY, 0, -1, withscores=True)
        # Taken, not read: counters deleted in the same MULTI start again at zero for the next tick.
        pipe.hgetall(TOKENS_KEY)
        pipe.zrange(KEYS_USED_KEY, 0, -1, withscores=True)
        pipe.hgetall(CONTINUATIONS_KEY)
        pipe.delete(TOKENS_KEY, KEYS_USED_KEY, CONTINUATIONS_KEY)
        _, raw_marks, rows, raw_tokens, key_rows, raw_continuations, _ = cast(
            tuple[
                int,
                dict[bytes, bytes],
                list[tuple[bytes, float]],
                dict[bytes, bytes],
                list[tuple[bytes, float]],
                dict[bytes, bytes],
                int,
            ],
            pipe.execute(),
        )
        routers = []
        for key, raw in raw_marks.items():
            try:
                routers.append(_parse_mark(key.decode(), raw))
            except ValueError as exc:  # skipped: its router's next report rewrites it
                log.warning("%s", exc)
        tokens, replica_tokens = parse_token_fields(raw_tokens)
        return UsageSnapshot(
            stamps={member.decode(): score for member, score in rows},
            routers=routers,
            tokens=tokens,
            keys={member.decode(): score for member, score in key_rows},
            continuations=parse_continuation_fields(raw_continuations),
            replica_tokens=replica_tokens,
        )

    def take_tokens(self) -> tuple[dict[int, TokenCounts], dict[str, float]]:
        pipe = self._sync.pipeline(transaction=True)
        self._sweep_budgets(pipe)
        pipe.hgetall(TOKENS_KEY)
        pipe.zrange(KEYS_USED_KEY, 0, -1, withscores=True)
        pipe.delete(TOKENS_KEY, KEYS_USED_KEY)  # in the same MULTI: taken by exactly one caller
        _, raw_tokens, key_rows, _ = cast(
            tuple[int, dict[bytes, bytes], list[tuple[bytes, float]], int],
            pipe.execute(),
        )
        # Router-only mode's store: no replicas of the control plane's, so no showback; their tokens are dropped.
        return parse_token_fields(raw_tokens)[0], {member.decode(): score for member, score in key_rows}

    def take_records(self) -> list[RequestRecord]:
        pipe = self._sync.pipeline(transaction=True)
        pipe.lrange(RECORDS_KEY, 0, -1)
        pipe.delete(RECORDS_KEY)  # in the same MULTI: taken by exactly one caller
        batches, _ = cast(tuple[list[bytes], int], pipe.execute())
        records: list[RequestRecord] = []
        for batch in batches:
            try:
                records.extend(_decode_records(batch))
            except msgspec.DecodeError as exc:  # dropped, not fatal: the others are good
                log.warning("dropping a malformed batch of request records: %s", exc)
        return records

    def restore_records(self, records: list[RequestRecord]) -> None:
        if records:
            self._sync.lpush(RECORDS_KEY, msgspec.msgpack.encode(records))

    def _sweep_budgets(self, pipe: Any) -> None:
        """Queue the script charging expired budget reservations to the ledger (EVAL: a pipeline's registered
        script costs a SCRIPT EXISTS first)."""
        now = self._clock()
        pipe.eval(SWEEP_LUA, len(LEDGER_KEYS), *LEDGER_KEYS, int(now * 1000), hour_of(now))

    def take_continuations(self) -> dict[int, ContinuationCounts]:
        pipe = self._sync.pipeline(transaction=True)
        pipe.hgetall(CONTINUATIONS_KEY)
        pipe.delete(CONTINUATIONS_KEY)  # in the same MULTI: taken by exactly one caller
        raw, _ = cast(tuple[dict[bytes, bytes], int], pipe.execute())
        return parse_continuation_fields(raw)

    def router_marks(self) -> list[RouterMark]:
        marks = []
        for key, raw in cast(dict[bytes, bytes], self._sync.hgetall(ROUTERS_KEY)).items():
            try:
                marks.append(_parse_mark(key.decode(), raw))
            except ValueError as exc:  # skipped: its router's next report rewrites it
                log.warning("%s", exc)
        return marks

    def restore_tokens(
        self, tokens: dict[int, TokenCounts], keys: dict[str, float], replicas: dict[int, ReplicaTokens] | None = None
    ) -> None:
        pipe = self._sync.pipeline(transaction=True)
        for hour in tokens.keys() | (replicas or {}).keys():
            for name, amount in token_fields(hour, tokens.get(hour, {}), (replicas or {}).get(hour)).items():
                pipe.hincrby(TOKENS_KEY, name, amount)
        if keys:
            pipe.zadd(KEYS_USED_KEY, keys, gt=True)
        pipe.execute()

    def restore_continuations(self, continuations: dict[int, ContinuationCounts]) -> None:
        pipe = self._sync.pipeline(transaction=True)
        for hour, counts in continuations.items():
            for name, amount in continuation_fields(hour, counts).items():
                pipe.hincrby(CONTINUATIONS_KEY, name, amount)
        pipe.execute()

    def forget_usage(self, replica_ids: Iterable[str | int]) -> None:
        ids = [str(r) for r in replica_ids]
        if ids:
            self._sync.zrem(USAGE_KEY, *ids)

    def drain_activations(self) -> set[Activation]:
        pipe = self._sync.pipeline(transaction=True)
        pipe.smembers(ACTIVATIONS_KEY)
        pipe.delete(ACTIVATIONS_KEY)
        members, _ = pipe.execute()
        # A malformed member (logged by decode_activation) is skipped: the others are still started.
        return {a for a in map(decode_activation, members) if a is not None}

    def forget_routers(self, routers: Iterable[str]) -> None:
        names = list(routers)
        if names:
            self._sync.hdel(ROUTERS_KEY, *names)

    # -- router side ----------------------------------------------------------
    async def read_endpoints(self) -> bytes | None:
        return cast(bytes | None, await self._aio().get(ENDPOINTS_KEY))

    async def watch_endpoints(self) -> AsyncIterator[bytes]:
        """Yield each table published on the channel, reconnecting after failures."""
        while True:
            pubsub = self._aio().pubsub()
            try:
                await pubsub.subscribe(self.endpoints_channel)
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        yield message["data"]
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down: the poll backstop covers the gap
                log.warning("endpoint subscription failed, retrying: %s", exc)
                await asyncio.sleep(1)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated

    async def report_usage(self, report: UsageReport) -> None:
        report = checked(report)
        pipe = self._aio().pipeline(transaction=True)
        if report.stamps:
            # GT: newest wins, so routers flushing out of order never move a stamp back.
            pipe.zadd(USAGE_KEY, report.stamps, gt=True)
        now = self._clock()
        if report.keys:
            pipe.zadd(KEYS_USED_KEY, report.keys, gt=True)
        if report.tokens or report.replica_tokens:
            # Counters, not newest-wins: every router's counts add up until a tick takes them.
            for name, amount in token_fields(hour_of(now), report.tokens, report.replica_tokens).items():
                pipe.hincrby(TOKENS_KEY, name, amount)
        for name, amount in continuation_fields(hour_of(now), report.continuations).items():
            pipe.hincrby(CONTINUATIONS_KEY, name, amount)
        if report.records:
            pipe.rpush(RECORDS_KEY, msgspec.msgpack.encode(report.records))
            pipe.ltrim(RECORDS_KEY, -MAX_RECORD_BATCHES, -1)  # nobody takes them: the newest are kept
        # After the stamps, in the same MULTI: a renewed mark vouches for what this router used.
        # EVAL, not a registered script: redis-py checks a pipeline's scripts with SCRIPT EXISTS
        # first, a second round trip per flush; Redis caches the compiled script either way.
        in_flight = msgspec.json.encode(report.in_flight).decode()
        windows = msgspec.json.encode(report.windows).decode()
        args = [report.router, repr(float(now)), repr(float(report.ttl)), in_flight, windows]
        pipe.eval(RENEW_MARK_LUA, 1, ROUTERS_KEY, *args)
        await pipe.execute()

    async def leave(self, router: str) -> None:
        await self._aio().hdel(ROUTERS_KEY, router)

    async def request_activation(self, model_name: str, pools: Iterable[str] = ()) -> None:
        await self._aio().sadd(ACTIVATIONS_KEY, encode_activation(Activation.of(model_name, pools)))

    # -- key changes ----------------------------------------------------------
    def publish_key_changes(self, digests: list[str]) -> None:
        if digests:
            self._sync.publish(self.key_changes_channel, json.dumps(list(digests)))

    async def watch_key_changes(self) -> AsyncIterator[list[str]]:
        """Yield each batch of changed key hashes published on the channel, reconnecting after failures."""
        while True:
            pubsub = self._aio().pubsub()
            try:
                await pubsub.subscribe(self.key_changes_channel)
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    try:
                        digests = json.loads(message["data"])
                    except ValueError:
                        digests = None
                    if isinstance(digests, list) and all(isinstance(d, str) for d in digests):
                        yield digests
                    else:
                        log.warning("ignoring a malformed key-change message: %r", message["data"][:200])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down: the key cache's positive TTL covers the gap
                log.warning("key-change subscription failed, retrying: %s", exc)
                await asyncio.sleep(1)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated

    def budget_use(self, counters: list[str]) -> dict[str, int]:
        pipe = self._sync.pipeline(transaction=False)
        for counter in counters:
            pipe.hmget(COUNTER_KEY.format(counter=counter), "hi", "lo")
        return {counter: used_of(raw) for counter, raw in zip(counters, pipe.execute(), strict=True)}

    async def reserve_budget(self, reservation: Reservation) -> Refusal | None:
        keys, args = reserve_call(reservation, self._clock())
        return refusal_of(reservation, await self._script(RESERVE_LUA, _RESERVE_SHA, keys, args))

    async def settle_budget(self, reservation_id: str, cost: int, hour: int) -> bool:
        keys, args = settle_call(reservation_id, cost, hour)
        return bool(await self._script(SETTLE_LUA, _SETTLE_SHA, keys, args))

    async def _script(self, script: str, sha: str, keys: list[str], args: list[Any]) -> Any:
        """Run a script in one round trip: by its digest, sent whole only when Redis does not have it yet."""
        client = self._aio()
        try:
            return await client.evalsha(sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return await client.eval(script, len(keys), *keys, *args)

    async def sync_limits(self, minute: int, deltas: LimitCounts) -> tuple[LimitCounts, int]:
        key = LIMITS_KEY.format(minute=minute)
        digests = sorted(deltas)
        pipe = self._aio().pipeline(transaction=True)
        for digest in digests:
            counts = deltas[digest]
            pipe.hincrby(key, f"requests {digest}", counts.requests)
            pipe.hincrby(key, f"tokens {digest}", counts.tokens)
        # Two minutes: long enough for every router's last exchange of the minute, then gone by itself.
        pipe.expire(key, 120)
        pipe.hlen(ROUTERS_KEY)
        replies = await pipe.execute()
        totals = {digest: LimitCount(int(replies[2 * i]), int(replies[2 * i + 1])) for i, digest in enumerate(digests)}
        return totals, max(1, int(replies[-1]))
