"""Rate limits per key: requests and tokens per minute, shared by routers through their usage flush."""

import asyncio
import math

import pytest

from conftest import wait_until
from hub import InProcessHub, RedisHub, get_hub
from hub.contracts import LimitCount
from keys.models import ApiKey
from router.accounting.limits import RateLimiter
from router.errors import RouterError
from router.tests.conftest import MODEL, chat_with_key, make_table

MINUTE = 1_800_000_000.0  # the start of some minute


class Clock:
    def __init__(self, now=MINUTE + 5):
        self.now = now

    def __call__(self):
        return self.now


def limited(limiter, times, *, rpm=None, tpm=None, digest="d", name="team"):
    """How many of `times` requests `limiter` admits before the first 429 (and that 429)."""
    for admitted in range(times):
        try:
            limiter.admit(digest, name, rpm, tpm)
        except RouterError as exc:
            return admitted, exc
    return times, None


def test_one_router_admits_exactly_its_rpm_then_answers_429_in_openai_shape():
    clock = Clock()
    admitted, refusal = limited(RateLimiter(clock), 10, rpm=3)
    assert admitted == 3
    assert refusal.status == 429 and refusal.code == "rate_limit_exceeded" and refusal.type == "requests"
    assert "limit 3, used 3" in refusal.message
    headers = dict(refusal.headers)
    assert headers[b"retry-after"] == b"55"
    assert headers[b"x-ratelimit-limit-requests"] == b"3"
    assert headers[b"x-ratelimit-remaining-requests"] == b"0"
    assert headers[b"x-ratelimit-reset-requests"] == b"55s"


def test_a_new_minute_starts_afresh():
    clock = Clock()
    limiter = RateLimiter(clock)
    assert limited(limiter, 5, rpm=2)[0] == 2
    clock.now += 60
    assert limited(limiter, 5, rpm=2)[0] == 2


def test_each_router_admits_at_most_its_share_whatever_the_timing_of_exchanges():
    """N routers, each up to ceil(rpm / N): together at most rpm + N - 1, however their exchanges interleave."""
    clock = Clock()
    first, second = RateLimiter(clock), RateLimiter(clock)
    for limiter in (first, second):
        limiter.apply(int(clock.now // 60), {}, routers=2)
    assert limited(first, 20, rpm=9)[0] == 5
    # `first` hands its 5 on; `second` has not heard the total yet, and keeps to its own share.
    minute, deltas = first.take()
    first.apply(minute, {"d": [5, 0]}, routers=2)
    assert limited(second, 20, rpm=9)[0] == 5  # 5 + 5 = 10: the worst case, rpm + routers - 1
    assert limited(first, 20, rpm=9)[0] == 0
    # Once `second` hands its 5 on, the hub's total (10) is over the limit: nothing more anywhere this minute.
    minute, deltas = second.take()
    second.apply(minute, {"d": [10, 0]}, routers=2)
    assert limited(second, 20, rpm=9)[0] == 0


def test_a_router_alone_admits_the_whole_limit_and_stops_when_the_total_is_reached():
    clock = Clock()
    limiter = RateLimiter(clock)
    limiter.admit("d", "team", 10, None)
    minute, _ = limiter.take()
    limiter.apply(minute, {"d": [8, 0]}, routers=1)  # other routers that left spent 7 more this minute
    assert limited(limiter, 10, rpm=10)[0] == 2


def test_counts_the_hub_did_not_take_still_count_here():
    clock = Clock()
    limiter = RateLimiter(clock)
    assert limited(limiter, 2, rpm=5)[0] == 2
    minute, deltas = limiter.take()
    limiter.restore(minute, deltas)
    assert limited(limiter, 10, rpm=5)[0] == 3


def test_tokens_per_minute_stop_a_key_once_spent():
    clock = Clock()
    limiter = RateLimiter(clock)
    limiter.admit("d", "team", None, 10)
    limiter.spent_tokens("d", 12)  # an answer may take the key past its limit: tokens are known only afterwards
    admitted, refusal = limited(limiter, 3, tpm=10)
    assert admitted == 0 and refusal.type == "tokens"
    assert dict(refusal.headers)[b"x-ratelimit-remaining-tokens"] == b"0"


def test_keys_without_limits_are_not_tracked():
    limiter = RateLimiter(Clock())
    limiter.spent_tokens("unlimited", 1000)
    assert limiter.limited_keys() == 0 and limiter.take()[1] == {}


@pytest.mark.parametrize("kind", ["in-process", "redis"])
def test_hubs_add_up_every_routers_counts_per_minute(kind, request):
    hub = RedisHub(request.getfixturevalue("redis_url")) if kind == "redis" else InProcessHub()

    async def exchange():
        first = await hub.sync_limits(7, {"k": LimitCount(requests=2, tokens=10)})
        second = await hub.sync_limits(7, {"k": LimitCount(3, 0), "other": LimitCount(1, 1)})
        next_minute = await hub.sync_limits(8, {"k": LimitCount(1, 0)})
        return first, second, next_minute

    first, second, next_minute = asyncio.run(exchange())
    assert first == ({"k": LimitCount(requests=2, tokens=10)}, 1)
    assert second == ({"k": LimitCount(5, 10), "other": LimitCount(1, 1)}, 1)
    assert next_minute[0] == {"k": LimitCount(1, 0)}
    assert all(type(counts) is LimitCount for counts in second[0].values())


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["in-process", "redis"])
def test_two_routers_share_one_rpm_within_the_stated_overshoot(kind, request, start_router, start_engine):
    """Worst case per minute: rpm + routers - 1 (each router admits at most its share, rounded up)."""
    clock = Clock()  # one minute window for the whole test, whatever the wall clock says
    if kind == "redis":
        url = request.getfixturevalue("redis_settings")
        hubs = [RedisHub(url), RedisHub(url)]
    else:
        hubs = [get_hub(), get_hub()]
    get_hub().publish_endpoints(make_table([start_engine().url]))
    routers = [start_router(hub, flush_seconds=0.05, clock=clock) for hub in hubs]
    wait_until(lambda: all(router.state.routes.endpoints(MODEL) for router in routers))  # both have the table
    rpm = 10
    _, key = ApiKey.issue("shared", rpm=rpm)

    answers = []
    for _ in range(3 * rpm):
        for router in routers:
            answers.append(chat_with_key(router, key).status_code)
    admitted = answers.count(200)
    assert set(answers) == {200, 429}
    assert rpm <= admitted <= rpm + len(routers) - 1


@pytest.mark.django_db(transaction=True)
def test_a_key_out_of_tokens_gets_429_with_token_headers(start_router, start_engine):
    get_hub().publish_endpoints(make_table([start_engine().url]))
    router = start_router(get_hub())
    _, key = ApiKey.issue("thrifty", tpm=8)  # the engine's answers cost 4 tokens each

    codes = [chat_with_key(router, key) for _ in range(5)]

    assert [c.status_code for c in codes] == [200, 200, 429, 429, 429]
    refused = codes[2]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.json()["error"]["type"] == "tokens"
    assert refused.headers["x-ratelimit-limit-tokens"] == "8"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert math.isfinite(float(refused.headers["retry-after"]))
