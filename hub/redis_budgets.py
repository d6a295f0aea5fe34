"""Budgets in Redis, shared by every router: each step of hub.budgets is one Lua script, so two routers
reserving at once see each other's reservations and no budget is ever overrun.

A budget's counter is a hash `llmgw:budget:<counter>` of two fields: `hi`, whole millionths of the currency
unit, and `lo`, the spend units below one (0 ≤ lo < 10^6). Lua counts in doubles, exact up to 2^53 only: one
integer of spend units would lose units past 9,007 of the currency, two parts stay exact to 9·10^9. A
windowed counter is kept until a day after its window ends. Reservations are one hash (id → amount, ledger
field and counters) and one sorted set (id → expiry, ms): `reserve` first charges up to `SWEEP` expired ones to
the ledger at what they reserved, and `sweep` (the control plane's tick) the rest. Settling adds the cost to
the hub's token counters (hub.redis_hub.TOKENS_KEY, field `spend <hour> <digest> <model>`) in the same script.

The hub is one Redis (a replicated primary, not a Cluster): a script names keys it builds from what it stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hub.budgets import Refusal, Reservation

COUNTER_KEY = "llmgw:budget:{counter}"
RESERVATIONS_KEY = "llmgw:budget:reservations"
EXPIRY_KEY = "llmgw:budget:expiry"
TOKENS_KEY = "llmgw:usage:tokens"  # hub.redis_hub.TOKENS_KEY: the ledger
PART = 10**6  # `lo` runs below this
SWEEP = 16  # expired reservations charged by each reservation

# Shared by the scripts: add (hi, lo) to a counter, and charge expired reservations to the ledger.
_COMMON = """
local PART = 1000000
local function add(key, hi, lo)
  local l = redis.call('HINCRBY', key, 'lo', lo)
  redis.call('HINCRBY', key, 'hi', hi)
  if l >= PART or l < 0 then
    local carry = math.floor(l / PART)
    redis.call('HINCRBY', key, 'lo', -carry * PART)
    redis.call('HINCRBY', key, 'hi', carry)
  end
end
local function parts(units)
  local n = string.len(units)
  if n <= 6 then return 0, tonumber(units) end
  return tonumber(string.sub(units, 1, n - 6)), tonumber(string.sub(units, n - 5))
end
local function sweep(now, hour, limit)
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, limit)
  for _, id in ipairs(expired) do
    local held = redis.call('HGET', KEYS[1], id)
    if held then
      local amount, ledger = string.match(held, '^(%d+) ([^\\n]*)\\n')
      redis.call('HINCRBY', KEYS[3], 'spend ' .. hour .. ' ' .. ledger, amount)
      redis.call('HINCRBY', KEYS[3], 'requests ' .. hour .. ' ' .. ledger, 1)
      redis.call('HDEL', KEYS[1], id)
    end
    redis.call('ZREM', KEYS[2], id)
  end
  return #expired
end
"""

# KEYS: reservations, expiry, tokens, then the counters. ARGV: id, amount (spend units, decimal text), ledger
# field ("<digest> <model>"), now (ms), expiry (ms), hour, then per counter: limit (text) and keep (s, 0 = ever).
# Returns {0, ""} when taken, else the 1-based index of the first counter it would overrun and its use (text).
RESERVE_LUA = (
    _COMMON
    + """
sweep(ARGV[4], ARGV[6], 16)
local ahi, alo = parts(ARGV[2])
local n = #KEYS - 3
for i = 1, n do
  local used = redis.call('HMGET', KEYS[3 + i], 'hi', 'lo')
  local hi, lo = tonumber(used[1] or '0'), tonumber(used[2] or '0')
  local lhi, llo = parts(ARGV[5 + 2 * i])
  local shi, slo = hi + ahi, lo + alo
  if slo >= PART then shi, slo = shi + 1, slo - PART end
  if shi > lhi or (shi == lhi and slo > llo) then
    return {i, string.format('%d%06d', hi, lo)}
  end
end
local counters = {}
for i = 1, n do
  add(KEYS[3 + i], ahi, alo)
  local keep = tonumber(ARGV[6 + 2 * i])
  if keep > 0 then redis.call('EXPIRE', KEYS[3 + i], keep) end
  counters[i] = KEYS[3 + i]
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. ARGV[3] .. '\\n' .. table.concat(counters, ' '))
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
return {0, ''}
"""
)

# KEYS: reservations, expiry, tokens. ARGV: id, the real cost (spend units, text), hour. Returns 1 if settled,
# 0 if the reservation had expired (charged already, as reserved).
SETTLE_LUA = (
    _COMMON
    + """
local held = redis.call('HGET', KEYS[1], ARGV[1])
if not held then
  return 0
end
local amount, ledger, counters = string.match(held, '^(%d+) ([^\\n]*)\\n(.*)$')
local ahi, alo = parts(amount)
local chi, clo = parts(ARGV[2])
for counter in string.gmatch(counters, '%S+') do
  if redis.call('EXISTS', counter) == 1 then
    add(counter, chi - ahi, clo - alo)
  end
end
if ARGV[2] ~= '0' then
  redis.call('HINCRBY', KEYS[3], 'spend ' .. ARGV[3] .. ' ' .. ledger, ARGV[2])
end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""
)

# KEYS: reservations, expiry, tokens. ARGV: now (ms), hour. Charges every expired reservation; returns how many.
SWEEP_LUA = _COMMON + "\nreturn sweep(ARGV[1], ARGV[2], -1)\n"

LEDGER_KEYS = [RESERVATIONS_KEY, EXPIRY_KEY, TOKENS_KEY]


def reserve_call(reservation: Reservation, now: float) -> tuple[list[str], list[Any]]:
    """(keys, args) of RESERVE_LUA for `reservation` at Unix time `now`."""
    keys = [*LEDGER_KEYS, *(COUNTER_KEY.format(counter=limit.counter) for limit in reservation.limits)]
    args: list[Any] = [
        reservation.id,
        str(reservation.amount),
        reservation.ledger,
        int(now * 1000),
        int((now + reservation.ttl) * 1000),
        int(now // 3600) * 3600,
    ]
    for limit in reservation.limits:
        args += [str(limit.limit), limit.keep]
    return keys, args


def refusal_of(reservation: Reservation, reply: list[Any]) -> Refusal | None:
    """RESERVE_LUA's reply as hub.budgets has it."""
    index, used = int(reply[0]), reply[1]
    if index == 0:
        return None
    refused = reservation.limits[index - 1]
    return Refusal(refused.counter, int(used), refused.limit)


def settle_call(reservation_id: str, cost: int, hour: int) -> tuple[list[str], list[Any]]:
    """(keys, args) of SETTLE_LUA."""
    return LEDGER_KEYS, [reservation_id, str(cost), hour]


def used_of(raw: list[bytes | None]) -> int:
    """A counter's HMGET hi lo as spend units."""
    return int(raw[0] or 0) * PART + int(raw[1] or 0)


class RedisBudgets:
    """The budgets' counters in Redis with a synchronous client (the control plane's, and tests')."""

    def __init__(self, client: Any, clock: Callable[[], float] = time.time) -> None:
        self._client = client
        self._clock = clock
        self._reserve = client.register_script(RESERVE_LUA)
        self._settle = client.register_script(SETTLE_LUA)
        self._sweep = client.register_script(SWEEP_LUA)

    def reserve(self, reservation: Reservation) -> Refusal | None:
        """Take the reservation's amount from every budget of its limits, or from none (hub.budgets)."""
        keys, args = reserve_call(reservation, self._clock())
        return refusal_of(reservation, self._reserve(keys=keys, args=args))

    def settle(self, reservation_id: str, cost: int, hour: int) -> bool:
        """Charge the real `cost` in place of what was reserved, and to the ledger; False if it had expired."""
        keys, args = settle_call(reservation_id, cost, hour)
        return bool(self._settle(keys=keys, args=args))

    def sweep(self) -> int:
        """Charge every reservation expired by now to the ledger at what it reserved; how many."""
        now = self._clock()
        return int(self._sweep(keys=LEDGER_KEYS, args=[int(now * 1000), int(now // 3600) * 3600]))

    def used(self, counter: str) -> int:
        """What a budget's counter holds: spent and still reserved (spend units)."""
        return used_of(self._client.hmget(COUNTER_KEY.format(counter=counter), "hi", "lo"))
