"""Router-only mode serving: several engines per model balanced, ejected and retried as replicas are; each
engine's own key sent to it alone; rate limits shared and token usage stored, through Redis or in process."""

import asyncio
import time

import httpx
import msgspec
import pytest
from aiohttp import web

from conftest import wait_until
from hub import InProcessHub, RedisHub
from hub.contracts import EndpointRow, EndpointTable, ModelEntry, UsageReport
from keys.models import ApiKey, TokenUsage
from router.accounting.store import TokenStore
from router.config import RouterConfig
from router.endpoints.static import (
    SharedStaticHub,
    StaticHub,
    build_table,
    create_router_only_app,
    parse_endpoint_options,
)
from router.tests.conftest import MODEL, FakeEngine, RouterServer, new_picker
from router.tests.picking.test_engine_load import MetricsEngine, poll

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


class KeyedEngine(FakeEngine):
    """A FakeEngine that records the Authorization header of every request it gets."""

    def __init__(self, name: str, **kwargs):
        super().__init__(name, **kwargs)
        self.authorizations: list[str | None] = []

    async def _begin(self, request) -> dict:
        self.authorizations.append(request.headers.get("Authorization"))
        return await super()._begin(request)


@pytest.fixture
def keyed_engine():
    started: list[KeyedEngine] = []

    def start(name: str, **kwargs) -> KeyedEngine:
        engine = KeyedEngine(name, **kwargs).start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


def static_table(*rows: EndpointRow) -> EndpointTable:
    return EndpointTable(models={MODEL: ModelEntry()}, endpoints=list(rows))


def prompt(i: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}]}


def post(router, auth, body=BODY):
    return httpx.post(f"{router.url}/v1/chat/completions", headers=auth, json=body, timeout=10)


def test_each_attempt_sends_its_own_endpoints_key_and_never_the_clients(start_router, auth, keyed_engine):
    first, second = keyed_engine("first", status=503), keyed_engine("second")
    # `first` has the higher priority, so it is tried first; its 503 sends the request on to `second`.
    table = static_table(
        EndpointRow(replica_id="a", model=MODEL, url=first.url, priority=1, api_key="sk-engine-a"),
        EndpointRow(replica_id="b", model=MODEL, url=second.url, priority=0, api_key="sk-engine-b"),
    )
    router = start_router(StaticHub(table))
    answer = post(router, auth)
    assert answer.status_code == 200 and answer.headers["x-llmgw-replica"] == "b"
    assert first.authorizations == ["Bearer sk-engine-a"]
    assert second.authorizations == ["Bearer sk-engine-b"]


def test_an_endpoint_without_a_key_gets_no_authorization_at_all(start_router, auth, keyed_engine):
    engine = keyed_engine("open")
    router = start_router(StaticHub(static_table(EndpointRow(replica_id="a", model=MODEL, url=engine.url))))
    assert post(router, auth).status_code == 200
    assert engine.authorizations == [None]


class GuardedMetricsEngine(MetricsEngine):
    """/metrics behind a bearer key, as llama.cpp's `--api-key` guards it."""

    key = "sk-engine"

    async def _metrics(self, request):
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": {"message": "Invalid API Key"}}, status=401)
        return await super()._metrics(request)


def test_an_engines_load_is_read_with_its_own_key():
    engine = GuardedMetricsEngine("guarded").start()
    try:
        engine.report(4, 0.25)
        picker = new_picker()
        picker.routes.apply_table(
            static_table(
                EndpointRow(replica_id="k", model=MODEL, url=engine.url, api_key="sk-engine"),
                EndpointRow(replica_id="n", model=MODEL, url=engine.url),
            )
        )
        poll(picker)
        readings = {e.replica_id: e.engine_waiting for e in picker.routes.endpoints(MODEL)}
        assert readings == {"k": 4.0, "n": None}  # without the key: 401, so unknown
    finally:
        engine.stop()


def test_two_engines_of_one_model_are_both_used_and_a_killed_one_is_ejected_and_retried_around(
    start_router, auth, engine_process
):
    engines = [engine_process(), engine_process()]
    table = build_table(parse_endpoint_options([f"{MODEL}={e.url}" for e in engines]))
    router = start_router(StaticHub(table))
    # Prompts of their own: one prompt would stay with one engine (prefix affinity).
    served = {post(router, auth, prompt(i)).headers["x-llmgw-replica"] for i in range(16)}
    assert served == {"static-1", "static-2"}
    engines[0].kill()
    answers = [post(router, auth, prompt(i)) for i in range(6)]
    assert [a.status_code for a in answers] == [200] * 6
    assert {a.headers["x-llmgw-replica"] for a in answers} == {"static-2"}
    assert [e.replica_id for e in router.state.picker.ejected()] == ["static-1"]


def router_only(table, redis_url="", store_seconds=0.2) -> RouterServer:
    config = RouterConfig.from_settings(flush_seconds=0.1, poll_seconds=0.5, connect_timeout=1.0)
    return RouterServer(create_router_only_app(table, redis_url, config, store_seconds=store_seconds)).start()


def stored() -> list[tuple[str, str, int, int, int]]:
    return list(TokenUsage.objects.values_list("key_name", "model", "requests", "prompt_tokens", "completion_tokens"))


def test_routers_sharing_redis_share_one_limit_and_store_each_token_once(transactional_db, redis_url, start_engine):
    engine = start_engine()
    _, key = ApiKey.issue("shared", rpm=4)
    auth = {"Authorization": f"Bearer {key}"}
    table = build_table(parse_endpoint_options([f"{MODEL}={engine.url}"]))
    routers = [router_only(table, redis_url), router_only(table, redis_url)]
    try:
        # Each learns there are two of them once both have reported (the share: ceil(4 / 2) = 2 each).
        wait_until(lambda: all(r.state.ledger.limits.routers == 2 for r in routers), timeout=5)
        first = [post(routers[0], auth).status_code for _ in range(3)]
        assert first == [200, 200, 429]
        wait_until(lambda: stored() == [("shared", MODEL, 2, 2, 6)], timeout=5)
        second = [post(routers[1], auth).status_code for _ in range(3)]
        assert second == [200, 200, 429]  # the key's limit, 4, reached over both
        wait_until(lambda: stored() == [("shared", MODEL, 4, 4, 12)], timeout=5)
        time.sleep(0.5)  # more rounds of both stores: nothing is stored twice
        assert stored() == [("shared", MODEL, 4, 4, 12)]
    finally:
        for router in routers:
            router.stop()
    assert ApiKey.objects.get().last_used_at is not None


def test_without_redis_each_router_stores_its_own_tokens_and_its_last_at_shutdown(transactional_db, start_engine):
    engine = start_engine()
    _, key = ApiKey.issue("alone")
    table = build_table(parse_endpoint_options([f"{MODEL}={engine.url}"]))
    # A store interval longer than the test: only the store at shutdown can have stored anything.
    router = router_only(table, store_seconds=3600)
    try:
        assert [post(router, {"Authorization": f"Bearer {key}"}).status_code for _ in range(3)] == [200] * 3
        assert isinstance(router.state.hub, StaticHub)
    finally:
        router.stop()
    assert stored() == [("alone", MODEL, 3, 3, 9)]


# The store's pass closes stale database connections (and would store counts): it may touch the database.
@pytest.mark.django_db
def test_a_router_gone_silent_is_forgotten_so_the_others_shares_grow_back(redis_url):
    clock = [1000.0]
    hub = SharedStaticHub(static_table(), redis_url)
    hub._clock = lambda: clock[0]
    for router in ("alive", "killed"):
        report = UsageReport(router=router, ttl=3.0)
        asyncio.run(hub.report_usage(report))
    clock[0] += 100.0
    asyncio.run(hub.report_usage(UsageReport(router="alive", ttl=3.0)))
    store = TokenStore(hub, forget_seconds=60.0, clock=lambda: clock[0])
    store._store()
    assert [mark.router for mark in hub.router_marks()] == ["alive"]


def test_token_counts_are_taken_once_whichever_hub(redis_url):
    for hub in (InProcessHub(), RedisHub(redis_url)):
        counts = msgspec.convert({"d": {"m": [1, 2, 3]}}, dict[str, dict[str, list[int]]])
        report = msgspec.convert({"router": "r", "tokens": counts, "keys": {"d": 5.0}}, UsageReport)
        asyncio.run(hub.report_usage(report))
        tokens, keys = hub.take_tokens()
        assert [msgspec.to_builtins(t) for t in tokens.values()] == [{"d": {"m": [1, 2, 3, 0]}}] and keys == {"d": 5.0}
        assert hub.take_tokens() == ({}, {})


def test_an_unreachable_hub_is_said_once_not_every_round(caplog):
    # Nothing listens on port 1: every round fails to reach this Redis.
    store = TokenStore(SharedStaticHub(static_table(), "redis://127.0.0.1:1/0"), forget_seconds=60.0)

    async def rounds():
        try:
            return [await store.store() for _ in range(3)]
        finally:
            await store.close()

    with caplog.at_level("INFO", logger="router.accounting.store"):
        assert asyncio.run(rounds()) == [0, 0, 0]
    assert caplog.text.count("could not take token usage from the hub") == 1
