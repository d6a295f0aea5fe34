"""The Redis channel layer sized for a fleet, and delivery whose outcome the sender learns.

channels-redis keeps every stream a control-plane process holds on ONE Redis
sorted set (its process-local channels share the key), so its capacity bounds
a whole burst, not one node's queue; `group_send` drops what does not fit with
an INFO line and raises nothing; and its connection pool fails at once when
all connections are busy. `FleetChannelLayer` changes three things:

* its pool blocks (up to a timeout) for a free connection instead of failing,
  so a burst of agent connects waits its turn rather than answering HTTP 500;
* `send_to_groups` delivers many group messages in two Redis commands and
  says, for each, how many streams it reached and how many were full;
* a receiving process takes up to `receive_batch` waiting messages in one
  round trip instead of four round trips per message.

`deliver_to_groups` gives the same answer from any layer (the in-process one
of embedded mode has no capacity to speak of).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, cast

from channels.exceptions import ChannelFull
from channels_redis.core import RedisChannelLayer
from redis import asyncio as aioredis

# Deliver one serialized message per (key, capacity) unless the key is full; return the full ones' positions.
_SEND_SCRIPT = """
local now = tonumber(ARGV[#ARGV - 1])
local expiry = tonumber(ARGV[#ARGV])
local full = {}
for i = 1, #KEYS do
    redis.call('ZREMRANGEBYSCORE', KEYS[i], 0, now - expiry)
    if redis.call('ZCOUNT', KEYS[i], '-inf', '+inf') < tonumber(ARGV[i + #KEYS]) then
        redis.call('ZADD', KEYS[i], now, ARGV[i])
        redis.call('EXPIRE', KEYS[i], expiry)
    else
        full[#full + 1] = i
    end
end
return full
"""


# Each group's members, once the expired ones are dropped: one command for a whole burst's groups.
_MEMBERS_SCRIPT = """
local members = {}
for i = 1, #KEYS do
    redis.call('ZREMRANGEBYSCORE', KEYS[i], 0, ARGV[1])
    members[i] = redis.call('ZRANGE', KEYS[i], 0, -1)
end
return members
"""


@dataclass
class GroupDelivery:
    """What one group message reached: `members` streams in the group, `full` of them over capacity."""

    members: int
    full: int = 0

    @property
    def delivered(self) -> bool:
        """Whether at least one stream has the message waiting for it."""
        return self.members > self.full


class FleetChannelLayer(RedisChannelLayer):
    """RedisChannelLayer with a blocking connection pool, reported group delivery and batched receive."""

    def __init__(
        self, *args: Any, pool_size: int = 100, pool_timeout: float = 10.0, receive_batch: int = 100, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if pool_size < 1 or pool_timeout < 0 or receive_batch < 1:
            raise ValueError("pool_size and receive_batch must be at least 1, pool_timeout not negative")
        self.pool_size = pool_size
        self.pool_timeout = pool_timeout
        self.receive_batch = receive_batch

    def create_pool(self, index: int) -> Any:
        host = dict(self.hosts[index])
        if "address" not in host:
            return super().create_pool(index)
        address = host.pop("address")
        # Waiting for a connection is what a burst needs; redis-py's default pool raises at once.
        return aioredis.BlockingConnectionPool.from_url(
            address, max_connections=self.pool_size, timeout=self.pool_timeout, **host
        )

    async def send_to_groups(self, items: list[tuple[str, dict[str, Any]]]) -> list[GroupDelivery]:
        """Send each (group, message); say for each how many streams it reached and how many were full.

        Two round trips per Redis host whatever the number of items: the groups'
        members in one script, then every write in another.
        """
        now = time.time()
        members: list[list[str]] = [[] for _ in items]
        by_host: dict[int, list[int]] = defaultdict(list)
        for position, (group, _) in enumerate(items):
            assert self.require_valid_group_name(group), "Group name not valid"
            by_host[self.consistent_hash(group)].append(position)
        for index, positions in by_host.items():
            keys = [self._group_key(items[position][0]) for position in positions]
            # One script, not two pipelined commands per group: packing and parsing 2,000 replies was
            # most of a thousand-node burst's cost before its first message left.
            found = await self.connection(index).eval(_MEMBERS_SCRIPT, len(keys), *keys, int(now) - self.group_expiry)
            for position, names in zip(positions, found, strict=True):
                members[position] = [m.decode("utf8") for m in names]

        outcome = [GroupDelivery(members=len(names)) for names in members]
        writes: dict[int, list[tuple[int, bytes, bytes, int]]] = defaultdict(list)
        for position, ((_, message), names) in enumerate(zip(items, members, strict=True)):
            for channel in names:
                local = self.non_local_name(channel) if "!" in channel else channel
                payload = self.serialize({**message, "__asgi_channel__": [channel]})
                key = (self.prefix + local).encode("utf8")
                writes[self.consistent_hash(local)].append((position, key, payload, self.get_capacity(channel)))
        for index, rows in writes.items():
            keys = [key for _, key, _, _ in rows]
            args = [payload for _, _, payload, _ in rows] + [capacity for _, _, _, capacity in rows]
            full = await self.connection(index).eval(_SEND_SCRIPT, len(keys), *keys, *args, now, self.expiry)
            for n in full:
                outcome[rows[int(n) - 1][0]].full += 1
        return outcome

    async def receive_single(self, channel: str) -> tuple[Any, dict[str, Any]]:
        """Take up to `receive_batch` waiting messages in one round trip; wait as channels-redis does when none.

        The extra messages go straight to their streams' buffers, as the parent's
        receive() does with the one it is given.
        """
        if "!" not in channel:
            return cast(tuple[Any, dict[str, Any]], await super().receive_single(channel))
        key = self.prefix + channel
        # ZPOPMIN's answer carries scores, which redis-py converts one by one (a third of the event
        # loop's time in a burst); the oldest members and their removal, in one MULTI, carry none.
        pipe = self.connection(self.consistent_hash(channel)).pipeline(transaction=True)
        pipe.zrange(key, 0, self.receive_batch - 1)
        pipe.zremrangebyrank(key, 0, self.receive_batch - 1)
        popped, _ = await pipe.execute()
        if not popped:
            return cast(tuple[Any, dict[str, Any]], await super().receive_single(channel))
        unpacked = [self._unpack(self.deserialize(content), channel) for content in popped]
        for target, message in unpacked[1:]:
            for name in target if isinstance(target, list) else [target]:
                self.receive_buffer[name].put_nowait(message)
        return unpacked[0]

    @staticmethod
    def _unpack(message: dict[str, Any], channel: str) -> tuple[Any, dict[str, Any]]:
        target = message.pop("__asgi_channel__", channel)
        return target, message


async def deliver_to_groups(layer: Any, items: list[tuple[str, dict[str, Any]]]) -> list[GroupDelivery]:
    """`send_to_groups` on any channel layer; one without it reports one member reached per group it accepted."""
    if isinstance(layer, FleetChannelLayer):
        return await layer.send_to_groups(items)
    outcome = []
    for group, message in items:
        try:
            await layer.group_send(group, message)
        except ChannelFull:
            outcome.append(GroupDelivery(members=1, full=1))
        else:
            outcome.append(GroupDelivery(members=1))
    return outcome
