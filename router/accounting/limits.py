"""Requests and tokens per minute per API key, shared by every router without a network call per request.

Minutes are fixed windows of the wall clock (UTC), the same on every router.
Each of the N routers reporting usage may admit a limited key's requests up to
its share of the limit, ceil(limit / N), and never once the key's total over
every router (as of its last exchange with the hub) has reached the limit.
Once a flush interval it hands the hub what it admitted (and the tokens those
requests spent) and takes back the key's totals and N.

Worst case, per key and minute, while the routers are stable: at most
`rpm + N - 1` requests (N shares, each rounded up), whatever the timing of
the exchanges; tokens at most `tpm + N - 1` plus the tokens of the answers in
flight when a router's share ran out (tokens are known only once an answer is
complete). The price of that bound: a key whose traffic reaches only one of N
routers gets about rpm / N there. A router learns N at start and at each
exchange; while routers join, a share is computed on the old N for up to a
flush interval. Keys without limits cost nothing here: the app does not call in.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from hub.contracts import LimitCount, LimitCounts
from router.errors import RouterError

WINDOW_SECONDS = 60


@dataclass(slots=True)
class _KeyWindow:
    """One limited key's state in the current minute on this router."""

    rpm: int | None
    tpm: int | None
    minute: int
    name: str = ""
    admitted: int = 0  # requests admitted here this minute
    spent: int = 0  # tokens spent here this minute
    requests: int = 0  # of which not yet handed to the hub
    tokens: int = 0
    total_requests: int = 0  # every router, as of the last exchange
    total_tokens: int = 0


class RateLimiter:
    """Admits limited keys' requests up to this router's share; see the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._keys: dict[str, _KeyWindow] = {}
        self.routers = 1  # routers reporting usage, as of the last exchange

    def admit(self, digest: str, name: str, rpm: int | None, tpm: int | None) -> None:
        """Count one request of a limited key, or raise a 429 RouterError in OpenAI's shape."""
        minute = int(self._clock() // WINDOW_SECONDS)
        state = self._keys.get(digest)
        if state is None or state.minute != minute or state.rpm != rpm or state.tpm != tpm:
            state = self._keys[digest] = _KeyWindow(rpm, tpm, minute, name)
        routers = self.routers
        # `used * routers >= limit` is `used >= ceil(limit / routers)`, the share, without dividing.
        if rpm is not None and (state.admitted * routers >= rpm or state.total_requests + state.requests >= rpm):
            raise self._limited(state, "requests")
        if tpm is not None and (state.spent * routers >= tpm or state.total_tokens + state.tokens >= tpm):
            raise self._limited(state, "tokens")
        state.admitted += 1
        state.requests += 1

    def spent_tokens(self, digest: str | None, tokens: int) -> None:
        """Tokens an answer of a limited key spent (other keys are not tracked)."""
        state = self._keys.get(digest) if digest is not None else None
        if state is not None and tokens > 0:
            state.spent += tokens
            state.tokens += tokens

    def take(self) -> tuple[int, LimitCounts]:
        """(this minute, the counts per key digest admitted here since the last exchange), for the hub."""
        minute = int(self._clock() // WINDOW_SECONDS)
        deltas: LimitCounts = {}
        for digest, state in list(self._keys.items()):
            if state.minute != minute:
                del self._keys[digest]  # an old minute's counts no longer limit anything
                continue
            deltas[digest] = LimitCount(state.requests, state.tokens)
            # Handed on: the hub's totals will count them from now on.
            state.total_requests += state.requests
            state.total_tokens += state.tokens
            state.requests = state.tokens = 0
        return minute, deltas

    def restore(self, minute: int, deltas: LimitCounts) -> None:
        """Put back counts the hub did not take, so they are handed on at the next exchange."""
        for digest, (requests, tokens) in deltas.items():
            state = self._keys.get(digest)
            if state is not None and state.minute == minute:
                state.requests += requests
                state.tokens += tokens
                state.total_requests -= requests
                state.total_tokens -= tokens

    def apply(self, minute: int, totals: LimitCounts, routers: int) -> None:
        """The hub's answer: each key's totals over every router this minute, and how many routers report."""
        self.routers = max(1, routers)
        for digest, (requests, tokens) in totals.items():
            state = self._keys.get(digest)
            if state is not None and state.minute == minute:
                # What was admitted here since the exchange began is not in the hub's totals yet.
                state.total_requests, state.total_tokens = requests, tokens

    def limited_keys(self) -> int:
        return len(self._keys)

    def _limited(self, state: _KeyWindow, kind: str) -> RouterError:
        now = self._clock()
        reset = max(1, math.ceil((state.minute + 1) * WINDOW_SECONDS - now))
        limit = state.rpm if kind == "requests" else state.tpm
        used_requests = max(state.total_requests + state.requests, state.admitted)
        used_tokens = max(state.total_tokens + state.tokens, state.spent)
        used = used_requests if kind == "requests" else used_tokens
        headers = [(b"retry-after", str(reset).encode())]
        for each, each_limit, each_used in (
            ("requests", state.rpm, used_requests),
            ("tokens", state.tpm, used_tokens),
        ):
            if each_limit is not None:
                headers += [
                    (f"x-ratelimit-limit-{each}".encode(), str(each_limit).encode()),
                    (f"x-ratelimit-remaining-{each}".encode(), str(max(0, each_limit - each_used)).encode()),
                    (f"x-ratelimit-reset-{each}".encode(), f"{reset}s".encode()),
                ]
        short = "rpm" if kind == "requests" else "tpm"
        scope = f"this router's share ({math.ceil((limit or 0) / self.routers)} of {limit}, {self.routers} routers)"
        return RouterError(
            429,
            f"Rate limit reached for {kind} per minute ({short}) on API key “{state.name}”: "
            f"limit {limit}, used {used}" + (f"; {scope}" if self.routers > 1 else "") + f". Retry after {reset} s.",
            "rate_limit_exceeded",
            type_=kind,
            headers=headers,
        )
