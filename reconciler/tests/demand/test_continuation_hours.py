"""Continuation counts stored by the tick (and by router-only mode's store): per model and hour, added in the
database in a fixed number of queries, given back to the hub when the database refuses them."""

import asyncio
import logging
import threading
from datetime import UTC, datetime

import msgspec
import pytest
from django.db import connections

from hub import InProcessHub, RedisHub
from hub.contracts import ContinuationCount, ContinuationCounts, UsageReport, UsageSnapshot
from keys.models import ContinuationHour
from keys.usage import UPSERT_BATCH, store_continuations
from reconciler.demand.tokens import record_token_usage
from router.accounting.store import TokenStore

pytestmark = pytest.mark.django_db

H0 = 1_800_000_000  # an hour's start
H1 = H0 + 3600
FIELDS = [f.name for f in msgspec.structs.fields(ContinuationCount)]


def counted(counts) -> ContinuationCounts:
    """{model: [continued, failed, refused, reprocessed]} as routers send it (unchecked, as a bug could)."""
    return {model: ContinuationCount(**dict(zip(FIELDS, row, strict=True))) for model, row in counts.items()}


def store(hours):
    """store_continuations of {hour: {model: [continued, failed, refused, reprocessed]}}."""
    return store_continuations({hour: counted(counts) for hour, counts in hours.items()})


def rows() -> dict:
    return {
        (row.model, row.hour.timestamp()): [row.continued, row.failed, row.refused, row.reprocessed_prompt_tokens]
        for row in ContinuationHour.objects.all()
    }


def test_counts_are_stored_per_model_and_hour_and_added_to_on_the_next_tick():
    assert store({H0: {"llama": [2, 1, 0, 300], "qwen": [0, 0, 1, 0]}}) == 2
    store({H0: {"llama": [1, 0, 0, 50]}, H1: {"llama": [0, 1, 0, 0]}})
    assert rows() == {
        ("llama", H0): [3, 1, 0, 350],
        ("qwen", H0): [0, 0, 1, 0],
        ("llama", H1): [0, 1, 0, 0],
    }
    assert ContinuationHour.objects.get(model="llama", hour=datetime.fromtimestamp(H1, tz=UTC)).failed == 1


@pytest.mark.parametrize("models", [1, 40])
def test_the_tick_stores_them_in_the_same_queries_for_one_model_and_for_many(models, django_assert_num_queries):
    hours = {hour: {f"m{i}": [1, 1, 1, 10] for i in range(models)} for hour in (H0, H1)}
    snapshot = UsageSnapshot(stamps={}, routers=[], continuations={h: counted(c) for h, c in hours.items()})
    assert UPSERT_BATCH >= 40 * 2, "both sizes fit one upsert"
    # The upsert, inside the savepoint the test's transaction makes of the store's transaction.
    with django_assert_num_queries(3):
        record_token_usage(snapshot, InProcessHub())
    assert ContinuationHour.objects.count() == 2 * models


def test_counts_the_database_refuses_go_back_to_the_hub(caplog):
    hub = InProcessHub()
    # A negative count breaks the rows' CHECK constraint: a real refusal by the database.
    refused = {H0: counted({"m": [1, -5, 0, 0]})}
    with caplog.at_level(logging.WARNING, logger="reconciler.demand.tokens"):
        record_token_usage(UsageSnapshot(stamps={}, routers=[], continuations=refused), hub)
    assert ContinuationHour.objects.count() == 0
    assert hub.collect_usage().continuations == refused
    assert "giving them back to the hub" in caplog.text


@pytest.mark.parametrize("backend", ["in-process", "redis"])
def test_two_routers_report_and_ticks_store_each_count_once(backend, request, run_tick):
    hub = InProcessHub() if backend == "in-process" else RedisHub(request.getfixturevalue("redis_url"))

    async def routers():
        await hub.report_usage(UsageReport(router="a", continuations=counted({"llama": [1, 0, 0, 40]})))
        await hub.report_usage(UsageReport(router="b", continuations=counted({"llama": [1, 1, 2, 0]})))

    asyncio.run(routers())
    run_tick(hub=hub)
    run_tick(hub=hub)  # the counts were taken by the first tick: a second one adds nothing
    (row,) = ContinuationHour.objects.all()
    assert [row.continued, row.failed, row.refused, row.reprocessed_prompt_tokens] == [2, 1, 2, 40]
    assert row.hour.minute == row.hour.second == 0


# The store's pass retires the thread's database connection as a request's end would: a transaction of its own.
@pytest.mark.django_db(transaction=True)
def test_router_only_mode_stores_them_itself(redis_url):
    """No tick there: the router's token store takes them from the hub like the token counts."""
    hub = RedisHub(redis_url)
    asyncio.run(hub.report_usage(UsageReport(router="a", continuations=counted({"llama": [1, 0, 0, 7]}))))
    TokenStore(hub, forget_seconds=60.0)._store()
    assert list(rows().values()) == [[1, 0, 0, 7]]
    assert hub.take_continuations() == {}


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_two_leaders_storing_at_once_add_up():
    """A paused leader and its successor may store what each took at the same moment: nothing is lost."""
    rounds = 25
    barrier = threading.Barrier(2)

    def leader():
        try:
            barrier.wait(5)
            for _ in range(rounds):
                store({H0: {"llama": [1, 2, 3, 4]}})
        finally:
            connections.close_all()

    threads = [threading.Thread(target=leader) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert rows() == {("llama", H0): [2 * rounds, 4 * rounds, 6 * rounds, 8 * rounds]}
