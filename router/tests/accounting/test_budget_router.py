"""Budgets through a running router: a request of a key with budgets reserves its worst case at admission against
each of them and settles its tokens at the table's prices when it ends, to the counters and the ledger alike; one
that does not fit is refused (429 budget_exceeded) naming the budget and when it resets; a key without budgets
has its spend counted with its tokens; an answer the client left is charged what it reserved."""

import json
import threading
from decimal import Decimal

import httpx
import msgspec
import pytest
import redis
from django.contrib.auth.models import User

from conftest import wait_until
from hub import InProcessHub, RedisHub
from hub.credentials import hash_secret
from keys.models import ApiKey, Budget
from router.tests.conftest import MODEL, make_table
from teams.models import Membership, Team

pytestmark = pytest.mark.django_db(transaction=True)

PRICE_IN, PRICE_OUT = 2 * 10**6, 10 * 10**6  # 2 and 10 per million tokens, in spend units per token
PRICED = {MODEL: {"aliases": [], "price_input": PRICE_IN, "price_output": PRICE_OUT, "output_bound": 100}}


@pytest.fixture(params=["in-process", "redis"])
def budget_hub(request):
    if request.param == "in-process":
        return InProcessHub()
    return RedisHub(request.getfixturevalue("redis_url"))


@pytest.fixture
def team_key(transactional_db):
    """A key of team “ml” held by ada, and ada's user."""
    team = Team.objects.create(name="ml")
    ada = User.objects.create_user("ada")
    Membership.objects.create(team=team, user=ada)
    return ApiKey.issue("ada's", team=team, user=ada)[1], team, ada


def used(hub, budget: Budget) -> int:
    """What a budget with no window holds, spent and reserved (spend units)."""
    counter = f"{budget.pk}:all"
    if isinstance(hub, InProcessHub):
        return hub.budgets.used(counter)
    from hub.redis_budgets import RedisBudgets

    return RedisBudgets(hub._sync).used(counter)


def body_of(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def post(router, key: str, content: bytes) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(f"{router.url}/v1/chat/completions", headers=headers, content=content, timeout=10)


def test_a_request_reserves_its_worst_case_and_settles_its_tokens_at_the_tables_prices(
    budget_hub, start_router, start_engine, team_key
):
    key, team, ada = team_key
    budget = Budget.objects.create(team=team, amount=Decimal("1"), window=Budget.Window.NONE)
    mine = Budget.objects.create(team=team, user=ada, amount=Decimal("1"), window=Budget.Window.NONE)
    engine = start_engine()
    engine.delay = 0.5  # the reservation is seen while the engine works
    budget_hub.publish_endpoints(make_table([engine.url], models=PRICED))
    router = start_router(budget_hub, flush_seconds=0.1)
    content = body_of(max_tokens=50)
    worst = len(content) * PRICE_IN + 50 * PRICE_OUT

    replies = []
    asking = threading.Thread(target=lambda: replies.append(post(router, key, content)))
    asking.start()
    wait_until(lambda: used(budget_hub, budget) > 0)
    assert used(budget_hub, budget) == used(budget_hub, mine) == worst  # every budget that applies holds it
    asking.join()
    assert replies[0].status_code == 200
    cost = 1 * PRICE_IN + 3 * PRICE_OUT  # the engine's usage: 1 prompt token, 3 completion tokens
    wait_until(lambda: used(budget_hub, budget) == cost)
    assert used(budget_hub, mine) == cost
    # The ledger has the same cost: the settlement's spend, with the router's count of the request and tokens.
    digest = hash_secret(key)
    wait_until(lambda: ledger(budget_hub, digest) == [1, 1, 3, cost])


def ledger(hub, digest: str) -> list[int] | None:
    """[requests, prompt, completion, spend] of the key's model in the hub, added over the hours (peeked)."""
    tokens = hub.take_tokens()[0]
    hub.restore_tokens(tokens, {})
    total = [0, 0, 0, 0]
    for counts in tokens.values():
        for i, value in enumerate(msgspec.to_builtins(counts.get(digest, {}).get(MODEL, [0, 0, 0, 0]))):
            total[i] += value
    return total


def test_a_request_that_does_not_fit_is_refused_naming_the_budget_and_its_reset(
    start_router, hub, start_engine, team_key
):
    key, team, _ = team_key
    Budget.objects.create(team=team, amount=Decimal("0.000300"), window=Budget.Window.DAY, timezone="Europe/Paris")
    engine = start_engine()
    hub.publish_endpoints(make_table([engine.url], models=PRICED))
    router = start_router()
    reply = post(router, key, body_of(max_tokens=50))  # its answer alone may cost 50 × 10 per million, 0.0005
    assert reply.status_code == 429
    error = reply.json()["error"]
    assert error["code"] == "budget_exceeded" and error["type"] == "insufficient_quota"
    assert "The daily budget of team “ml” is spent: 0.000000 of 0.000300 used or reserved" in error["message"]
    assert "it resets at " in error["message"] and "+01:00" in error["message"]  # Paris's midnight, in December
    assert 1 <= int(reply.headers["retry-after"]) <= 86_400
    assert engine.requests == []  # never sent
    assert post(router, key, body_of(max_tokens=5)).status_code == 200  # 0.000228 at most: it fits


def test_a_key_without_budgets_has_its_spend_counted_with_its_tokens(start_router, hub, start_engine, api_key, auth):
    engine = start_engine()
    hub.publish_endpoints(make_table([engine.url], models=PRICED))
    router = start_router(flush_seconds=60)
    assert post(router, api_key, body_of()).status_code == 200
    counts, _ = router.state.ledger.tokens.pending()
    assert msgspec.to_builtins(counts[hash_secret(api_key)][MODEL]) == [1, 1, 3, PRICE_IN + 3 * PRICE_OUT]


def test_an_answer_the_client_left_is_charged_what_it_reserved(start_router, hub, start_engine, team_key):
    key, team, _ = team_key
    budget = Budget.objects.create(team=team, amount=Decimal("1"), window=Budget.Window.NONE)
    engine = start_engine()
    engine.hold_first_chunk = True
    hub.publish_endpoints(make_table([engine.url], models=PRICED))
    router = start_router()
    content = body_of(max_tokens=40, stream=True)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", headers=headers, content=content) as reply:
        next(reply.iter_bytes())  # the first chunk; then the client hangs up
    engine.release.set()
    worst = len(content) * PRICE_IN + 40 * PRICE_OUT
    wait_until(lambda: router.state.ledger.in_flight() == 0)
    wait_until(lambda: used(hub, budget) == worst)


class UnreachableBudgets(InProcessHub):
    """A hub whose budget counters cannot be reached (Redis down, as redis-py raises it)."""

    async def reserve_budget(self, reservation):
        raise ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")


def test_budgets_that_cannot_be_counted_refuse_the_request_rather_than_let_it_through(
    start_router, start_engine, team_key
):
    key, team, _ = team_key
    Budget.objects.create(team=team, amount=Decimal("1"), window=Budget.Window.NONE)
    engine, hub = start_engine(), UnreachableBudgets()
    hub.publish_endpoints(make_table([engine.url], models=PRICED))
    router = start_router(hub)
    reply = post(router, key, body_of(max_tokens=5))
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["code"] == "budget_check_unavailable"
    assert engine.requests == []


def test_a_clients_next_request_finds_the_last_one_settled_at_its_real_cost(
    budget_hub, start_router, start_engine, team_key
):
    """A budget of exactly 19 answers' real cost and one worst case: 20 requests one after the other all fit only
    if each was settled before its client saw its end; the 21st does not."""
    key, team, _ = team_key
    content = body_of(max_tokens=50)
    worst, cost = len(content) * PRICE_IN + 50 * PRICE_OUT, 1 * PRICE_IN + 3 * PRICE_OUT
    amount = Decimal(worst + 19 * cost).scaleb(-12)
    budget = Budget.objects.create(team=team, amount=amount, window=Budget.Window.NONE)
    engine = start_engine()
    budget_hub.publish_endpoints(make_table([engine.url], models=PRICED))
    router = start_router(budget_hub)
    for done in range(1, 21):
        assert post(router, key, content).status_code == 200
        assert used(budget_hub, budget) == done * cost  # no wait: settled before the answer's last byte
    assert post(router, key, content).json()["error"]["code"] == "budget_exceeded"


def test_an_engines_error_costs_nothing(start_router, hub, start_engine, team_key):
    key, team, _ = team_key
    budget = Budget.objects.create(team=team, amount=Decimal("1"), window=Budget.Window.NONE)
    engine = start_engine(status=503)
    hub.publish_endpoints(make_table([engine.url], models=PRICED))
    router = start_router()
    assert post(router, key, body_of(max_tokens=5)).status_code == 503
    wait_until(lambda: router.state.ledger.in_flight() == 0)
    wait_until(lambda: used(hub, budget) == 0)  # reserved, then given back whole
    assert len(engine.requests) >= 1


def scripts_run(redis_url: str, action) -> list[str]:
    """The script commands (EVALSHA, EVAL) Redis received in the test's database while `action()` ran."""
    client = redis.Redis.from_url(redis_url)
    database = client.connection_pool.connection_kwargs.get("db", 0)
    seen: list[str] = []
    ready = threading.Event()

    def watch() -> None:
        with client.monitor() as monitor:
            ready.set()
            while True:
                command = monitor.next_command()
                words = command["command"].split()
                if words[0].upper() == "ECHO" and words[-1] == "llmgw-test-done":
                    return
                if command["db"] == database and words[0].upper() in ("EVALSHA", "EVAL"):
                    seen.append(words[0].upper())

    watcher = threading.Thread(target=watch)
    watcher.start()
    ready.wait(5)
    action()
    redis.Redis.from_url(redis_url).echo("llmgw-test-done")
    watcher.join(10)
    return seen


def test_a_budgeted_request_costs_two_redis_round_trips_and_any_other_none(
    redis_url, start_router, start_engine, team_key, api_key
):
    """DESIGN invariant 4 with budgets: one script at admission, one at settlement; a key without budgets runs no
    script (nor any command: the flush is a minute away)."""
    key, team, _ = team_key
    Budget.objects.create(team=team, amount=Decimal("1"), window=Budget.Window.NONE)
    hub = RedisHub(redis_url)
    hub.publish_endpoints(make_table([start_engine().url], models=PRICED))
    router = start_router(hub, flush_seconds=60)
    assert post(router, api_key, body_of()).status_code == 200  # the keys are cached before counting
    assert post(router, key, body_of(max_tokens=5)).status_code == 200
    assert scripts_run(redis_url, lambda: post(router, key, body_of(max_tokens=5))) == ["EVALSHA", "EVALSHA"]
    assert scripts_run(redis_url, lambda: post(router, api_key, body_of())) == []
