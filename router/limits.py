"""Requests and tokens per minute per API key, shared by every router without a network call per request.

Minutes are fixed windows of the wall clock (UTC), the same on every router.
Each router admits a limited key's requests from an allowance it holds in
memory; once a flush interval it hands the hub what it admitted (and the
tokens those requests spent) and gets back the key's totals over every router
this minute and how many routers report. Its next allowance is its share of
what is left: ceil((limit - total) / routers).

Worst case, per key and minute: the routers together admit at most
`rpm + routers - 1` requests (each share is rounded up), and spend at most
`tpm` plus the tokens of the requests admitted before the totals caught up:
tokens are known only once an answer is complete, so a request is admitted
while the key is under its limit and may end above it. Before a router's
first exchange with the hub in a minute (or while the hub is unreachable), it
admits its share as of its last exchange (the whole limit when it has never
had one). Keys without limits cost nothing here: the check returns at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import RouterError

WINDOW_SECONDS = 60


@dataclass
class _KeyWindow:
    """One limited key's state in the current minute on this router."""

    rpm: int | None
    tpm: int | None
    minute: int
    requests_allowed: float = math.inf
    tokens_allowed: float = math.inf
    requests: int = 0  # admitted here since the last exchange
    tokens: int = 0  # spent here since the last exchange
    total_requests: int = 0  # every router, as of the last exchange
    total_tokens: int = 0
    name: str = ""
    shares: int = field(default=1)


class RateLimiter:
    """Admits limited keys' requests from per-router allowances; see the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._keys: dict[str, _KeyWindow] = {}
        self._routers = 1  # routers reporting, as of the last exchange

    def admit(self, digest: str, name: str, rpm: int | None, tpm: int | None) -> None:
        """Count one request of a limited key, or raise a 429 RouterError in OpenAI's shape."""
        minute = int(self._clock() // WINDOW_SECONDS)
        state = self._keys.get(digest)
        if state is None or state.minute != minute or (state.rpm, state.tpm) != (rpm, tpm):
            state = self._keys[digest] = self._fresh(minute, rpm, tpm, name)
        if rpm is not None and state.requests >= state.requests_allowed:
            raise self._limited(state, "requests")
        if tpm is not None and state.tokens >= state.tokens_allowed:
            raise self._limited(state, "tokens")
        state.requests += 1

    def spent(self, digest: str | None, tokens: int) -> None:
        """Tokens an answer of a limited key spent (other keys are not tracked)."""
        state = self._keys.get(digest) if digest is not None else None
        if state is not None and tokens > 0:
            state.tokens += tokens

    def take(self) -> tuple[int, dict[str, list[int]]]:
        """(this minute, {digest: [requests, tokens]} admitted here since the last exchange), for the hub."""
        minute = int(self._clock() // WINDOW_SECONDS)
        deltas = {}
        for digest, state in list(self._keys.items()):
            if state.minute != minute:
                del self._keys[digest]  # an old minute's counts no longer limit anything
                continue
            deltas[digest] = [state.requests, state.tokens]
            # Handed on: what is left of the allowance until the hub's totals include them.
            state.requests_allowed -= state.requests
            state.tokens_allowed -= state.tokens
            state.requests = state.tokens = 0
        return minute, deltas

    def restore(self, minute: int, deltas: dict[str, list[int]]) -> None:
        """Put back counts the hub did not take, so this router's own admissions still count."""
        for digest, (requests, tokens) in deltas.items():
            state = self._keys.get(digest)
            if state is not None and state.minute == minute:
                state.requests += requests
                state.tokens += tokens
                state.requests_allowed += requests
                state.tokens_allowed += tokens

    def apply(self, minute: int, totals: dict[str, list[int]], routers: int) -> None:
        """The hub's totals over every router this minute: each key's next allowance is this router's share."""
        self._routers = max(1, routers)
        for digest, (requests, tokens) in totals.items():
            state = self._keys.get(digest)
            if state is None or state.minute != minute:
                continue
            state.total_requests, state.total_tokens = requests, tokens
            state.shares = self._routers
            state.requests_allowed = _share(state.rpm, requests, self._routers)
            state.tokens_allowed = _share(state.tpm, tokens, self._routers)

    def limited_keys(self) -> int:
        return len(self._keys)

    def _fresh(self, minute: int, rpm: int | None, tpm: int | None, name: str) -> _KeyWindow:
        # Until the first exchange of the minute: this router's share of the whole limit.
        return _KeyWindow(
            rpm,
            tpm,
            minute,
            requests_allowed=_share(rpm, 0, self._routers),
            tokens_allowed=_share(tpm, 0, self._routers),
            name=name,
            shares=self._routers,
        )

    def _limited(self, state: _KeyWindow, kind: str) -> RouterError:
        now = self._clock()
        reset = max(1, math.ceil((state.minute + 1) * WINDOW_SECONDS - now))
        limit = state.rpm if kind == "requests" else state.tpm
        used = (state.total_requests + state.requests) if kind == "requests" else (state.total_tokens + state.tokens)
        headers = [(b"retry-after", str(reset).encode())]
        for each, each_limit, each_used in (
            ("requests", state.rpm, state.total_requests + state.requests),
            ("tokens", state.tpm, state.total_tokens + state.tokens),
        ):
            if each_limit is not None:
                headers += [
                    (f"x-ratelimit-limit-{each}".encode(), str(each_limit).encode()),
                    (f"x-ratelimit-remaining-{each}".encode(), str(max(0, each_limit - each_used)).encode()),
                    (f"x-ratelimit-reset-{each}".encode(), f"{reset}s".encode()),
                ]
        short = "rpm" if kind == "requests" else "tpm"
        return RouterError(
            429,
            f"Rate limit reached for {kind} per minute ({short}) on API key “{state.name}”: "
            f"limit {limit}, used {used}. Retry after {reset} s.",
            "rate_limit_exceeded",
            type_=kind,
            headers=headers,
        )


def _share(limit: int | None, used: int, routers: int) -> float:
    """What one of `routers` routers may still admit of `limit` when `used` is spent; infinite without a limit."""
    if limit is None:
        return math.inf
    return math.ceil(max(0, limit - used) / routers)
