"""Budgets at the router: a request's worst-case cost reserved at admission against every budget that applies to
its key (the key's own, its holder's within the team, the team's), its real cost settled when the answer ends.

The worst case is what the request could cost at its model's prices (from the endpoint table): its prompt
counted as one token per byte of the request body (a token is at least a byte of text, and the body holds the
text and more), and its answer as the most tokens it may ask for (`max_tokens`, `max_completion_tokens` or
`max_output_tokens`, times `n`), else the model's served context (the table's `output_bound`), else
`default_output_tokens`. A request whose worst case is nothing (a free model) reserves nothing.

The settlement charges the answer's tokens at the same prices; an answer that began but whose usage never came
(the client left mid-stream, the engine broke and nothing finished it) is charged what was reserved: the router
cannot know what the engine spent, and hanging up must not make an answer free. An answer that never began
costs nothing. An answer relayed to its end is settled just before its last byte (router.forwarding.relay), so a
client that sends its next request once this one ended finds the budgets charged with its real cost; any other
end is settled in a task beside the request, and `close` waits for those still running. Keys without budgets cost one attribute check per request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

from hub.budgets import Limit, Refusal, Reservation, Window, counter_name, window
from hub.contracts import BudgetCounters, hour_of
from router.errors import RouterError

log = logging.getLogger(__name__)

# Fields a request names the most tokens of its answer by: Chat/Completions (and Anthropic), Chat's newer name,
# the Responses API's.
OUTPUT_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
WINDOW_WORDS = {Window.DAY: "daily", Window.WEEK: "weekly", Window.MONTH: "monthly", Window.NONE: "all-time"}
KEEP_AFTER_WINDOW = 86_400  # a window's counter outlives it by a day (a late settlement still finds it)


@dataclass(frozen=True, slots=True)
class BudgetRule:
    """One budget as a router knows it (from keys.Budget, read with the key): its limit in spend units."""

    id: int
    limit: int
    window: Window
    zone: str
    scope: str
    """Whose it is, in words: “key “ci””, “team “ml””, “ada in team “ml””."""


@dataclass(slots=True)
class Hold:
    """A request's reservation: what it reserved, at which prices, for the settlement."""

    id: str
    amount: int
    prices: tuple[int, int]
    ledger: str


class BudgetWindows:
    """Each budget's current window, computed once per window, not per request (time zones cost)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._current: dict[tuple[int, Window, str], tuple[float, str, int, datetime | None]] = {}

    def limits(self, rules: tuple[BudgetRule, ...]) -> list[Limit]:
        """The counters a request must fit now, one per budget."""
        now = self._clock()
        found = []
        for rule in rules:
            ident = (rule.id, rule.window, rule.zone)
            current = self._current.get(ident)
            if current is None or now >= current[0]:
                current = self._current[ident] = self._window(rule, now)
            found.append(Limit(current[1], rule.limit, current[2]))
        return found

    def reset_at(self, rule: BudgetRule) -> datetime | None:
        """When `rule`'s current window ends (None: never)."""
        current = self._current.get((rule.id, rule.window, rule.zone))
        return None if current is None else current[3]

    def _window(self, rule: BudgetRule, now: float) -> tuple[float, str, int, datetime | None]:
        start, end = window(rule.window, rule.zone, datetime.fromtimestamp(now, UTC))
        if end is None:
            return math.inf, counter_name(rule.id, None), 0, None
        keep = math.ceil(end.timestamp() - now) + KEEP_AFTER_WINDOW
        return end.timestamp(), counter_name(rule.id, start), keep, end


class BudgetGate:
    """Reserves at admission and settles at the end, against the hub's budget counters."""

    def __init__(
        self,
        counters: BudgetCounters,
        reservation_seconds: float,
        default_output_tokens: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._counters = counters
        self._ttl = reservation_seconds
        self._default_output = default_output_tokens
        self._clock = clock
        self.windows = BudgetWindows(clock)
        self._settling: set[asyncio.Task[None]] = set()

    async def reserve(
        self,
        rules: tuple[BudgetRule, ...],
        digest: str,
        request: tuple[str, bytes, dict[str, Any]],
        prices: tuple[int, int, int] | None,
    ) -> Hold | None:
        """Reserve a request's worst case against the budgets of its key (`rules`; `digest`: the key's): its Hold,
        None when it costs nothing, or a 429 RouterError naming the first budget it does not fit and when that
        budget resets. `request`: its model, body and decoded body; `prices`: the model's (input, output, output
        bound) from the table."""
        if prices is None:
            return None
        model, body, payload = request
        price_in, price_out, bound = prices
        asked = next((v for f in OUTPUT_LIMITS if isinstance(v := payload.get(f), int) and v >= 0), None)
        choices = payload.get("n")
        output = (asked if asked is not None else bound or self._default_output) * (
            choices if isinstance(choices, int) and choices > 1 else 1
        )
        amount = len(body) * price_in + output * price_out
        if amount == 0:
            return None
        limits = self.windows.limits(rules)
        hold = Hold(uuid.uuid4().hex, amount, (price_in, price_out), f"{digest} {model}")
        try:
            refusal = await self._counters.reserve_budget(Reservation(hold.id, amount, limits, self._ttl, hold.ledger))
        except Exception:
            # Refused, not let through: a budget that cannot be counted could be overrun.
            log.exception("could not reserve against the budgets of key %s", digest[:12])
            raise RouterError(
                503,
                "The budgets of this API key cannot be checked right now (the hub is unreachable). Retry shortly.",
                "budget_check_unavailable",
                type_="server_error",
                headers=[(b"retry-after", b"1")],
            ) from None
        if refusal is not None:
            raise self._refused(rules, limits, refusal, amount)
        return hold

    def settle(self, hold: Hold, usage: tuple[int, int] | None, began: bool) -> None:
        """Settle `hold` in a task of its own (an answer that broke, or was never given): the answer's tokens at
        its prices, its reservation when the answer `began` with no usage known, nothing when it never began."""
        task = asyncio.get_running_loop().create_task(self._settle(hold, cost_of(hold, usage, began)))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def settle_now(self, hold: Hold, usage: tuple[int, int] | None) -> None:
        """Settle the hold of an answer about to end whole (the relay awaits it before the last byte)."""
        await self._settle(hold, cost_of(hold, usage, True))

    async def _settle(self, hold: Hold, cost: int) -> None:
        try:
            if not await self._counters.settle_budget(hold.id, cost, hour_of(self._clock())):
                log.warning("budget reservation %s had expired: charged what it reserved", hold.id)
        except Exception:
            # Left to expire: charged at what it reserved, never free.
            log.exception("could not settle budget reservation %s; it expires charged as reserved", hold.id)

    async def close(self) -> None:
        """Wait for the settlements still running."""
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)

    def _refused(
        self, rules: tuple[BudgetRule, ...], limits: list[Limit], refusal: Refusal, amount: int
    ) -> RouterError:
        index = next(i for i, limit in enumerate(limits) if limit.counter == refusal.counter)
        rule = rules[index]
        reset = self.windows.reset_at(rule)
        headers = []
        if reset is None:
            when = "it has no window, so it does not reset"
        else:
            when = f"it resets at {reset.astimezone(ZoneInfo(rule.zone)).isoformat()}"  # the budget's own clock
            headers.append((b"retry-after", str(max(1, math.ceil(reset.timestamp() - self._clock()))).encode()))
        return RouterError(
            429,
            f"The {WINDOW_WORDS[rule.window]} budget of {rule.scope} is spent: {units(refusal.used)} of "
            f"{units(rule.limit)} used or reserved, and this request may cost up to {units(amount)}; {when}.",
            "budget_exceeded",
            type_="insufficient_quota",
            headers=headers,
        )


def cost_of(hold: Hold, usage: tuple[int, int] | None, began: bool) -> int:
    """What an answer is charged: its tokens at the prices it reserved with; without usage, its reservation if it
    began (the engine spent what the router cannot know), nothing if it never did."""
    if usage is not None:
        return usage[0] * hold.prices[0] + usage[1] * hold.prices[1]
    return hold.amount if began else 0


def units(amount: int) -> str:
    """Spend units as currency text, to the millionth (what a budget's amount is written to)."""
    return f"{Decimal(amount).scaleb(-12):.6f}"
