"""Budgets in Redis, shared by every router: each step of hub.budgets is one Lua script, so two routers
reserving at once see each other's reservations and no budget is ever overrun.

A budget's counter is a string of micro-units (`llmgw:budget:<id>:<window start>`), kept until a day after its
window ends; a reservation is a hash (its amount and counters) that expires after its TTL, leaving the counters
charged at what it reserved. Every key of a step carries the hash tag `{llmgw-budgets}`, so a Redis Cluster keeps
them in one slot, as a script needs.
"""

from __future__ import annotations

import redis

from hub.budgets import Limit, Refusal

COUNTER_KEY = "llmgw:budget:{{llmgw-budgets}}:{counter}"
RESERVATION_KEY = "llmgw:budget-reservation:{{llmgw-budgets}}:{reservation}"

# KEYS: the counters, then the reservation. ARGV: amount, reservation TTL (ms), counter TTL (s), then each
# counter's limit. Returns 0 when taken, else the 1-based index of the first counter it would overrun and its use.
RESERVE_LUA = """
local amount = tonumber(ARGV[1])
local n = #KEYS - 1
for i = 1, n do
  local used = tonumber(redis.call('GET', KEYS[i]) or '0')
  if used + amount > tonumber(ARGV[3 + i]) then
    return {i, used}
  end
end
for i = 1, n do
  redis.call('INCRBY', KEYS[i], amount)
  redis.call('EXPIRE', KEYS[i], ARGV[3])
end
redis.call('HSET', KEYS[n + 1], 'amount', amount, 'counters', table.concat(KEYS, ' ', 1, n))
redis.call('PEXPIRE', KEYS[n + 1], ARGV[2])
return {0, 0}
"""

# KEYS: the reservation. ARGV: the real cost. Returns 1 if settled, 0 if the reservation had expired.
SETTLE_LUA = """
local held = redis.call('HMGET', KEYS[1], 'amount', 'counters')
if not held[1] then
  return 0
end
local change = tonumber(ARGV[1]) - tonumber(held[1])
for counter in string.gmatch(held[2], '%S+') do
  if redis.call('EXISTS', counter) == 1 then
    redis.call('INCRBY', counter, change)
  end
end
redis.call('DEL', KEYS[1])
return 1
"""


class RedisBudgets:
    """The budgets' counters in Redis (synchronous client; a router calls it off its event loop)."""

    def __init__(self, client: redis.Redis, counter_ttl: int = 32 * 86400 + 86400) -> None:
        self._client = client
        self._counter_ttl = counter_ttl  # past the longest window (a month) and a day
        self._reserve = client.register_script(RESERVE_LUA)
        self._settle = client.register_script(SETTLE_LUA)

    def reserve(self, reservation: str, amount: int, limits: list[Limit], ttl: float) -> Refusal | None:
        """Take `amount` from every budget in `limits`, or from none; None if taken, else the first refusal."""
        keys = [COUNTER_KEY.format(counter=limit.counter) for limit in limits]
        keys.append(RESERVATION_KEY.format(reservation=reservation))
        args = [amount, max(1, int(ttl * 1000)), self._counter_ttl, *(limit.limit for limit in limits)]
        index, used = self._reserve(keys=keys, args=args)
        if index == 0:
            return None
        refused = limits[int(index) - 1]
        return Refusal(refused.counter, int(used), refused.limit)

    def settle(self, reservation: str, cost: int) -> bool:
        """Charge the real `cost` in place of what was reserved; False if the reservation had expired."""
        return bool(self._settle(keys=[RESERVATION_KEY.format(reservation=reservation)], args=[cost]))

    def used(self, counter: str) -> int:
        """What a budget's counter holds: spent and still reserved (micro-units)."""
        return int(self._client.get(COUNTER_KEY.format(counter=counter)) or 0)
