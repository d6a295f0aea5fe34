"""Token usage stored by the tick: per key, model and hour, added in the database, in a fixed number of queries."""

import asyncio
import logging
import threading
from datetime import UTC, datetime

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext

from hub import InProcessHub, RedisHub
from hub.contracts import TokenCount, UsageReport, UsageSnapshot
from hub.credentials import hash_secret
from keys.models import ApiKey, TokenUsage
from keys.usage import UPSERT_BATCH, store_tokens
from reconciler.demand.tokens import record_token_usage

pytestmark = pytest.mark.django_db

H0 = 1_800_000_000  # an hour's start
H1 = H0 + 3600


def counted(tokens):
    """{digest: {model: [requests, prompt, completion]}} as the TokenCounts routers send (unchecked, as a bug could)."""
    return {
        digest: {model: TokenCount(requests=row[0], prompt=row[1], completion=row[2]) for model, row in models.items()}
        for digest, models in tokens.items()
    }


def store(tokens, keys):
    """store_tokens of {hour: {digest: {model: [requests, prompt, completion]}}}."""
    return store_tokens({hour: counted(counts) for hour, counts in tokens.items()}, keys)


def at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def new_key(name: str) -> tuple[ApiKey, str]:
    key, plaintext = ApiKey.issue(name)
    return key, hash_secret(plaintext)


def rows() -> dict:
    return {
        (row.key_name, row.model, row.hour.timestamp()): [row.requests, row.prompt_tokens, row.completion_tokens]
        for row in TokenUsage.objects.all()
    }


def test_counts_are_stored_per_key_model_and_hour_and_added_to_on_the_next_tick():
    _, alice = new_key("alice")
    _, bob = new_key("bob")
    assert store({H0: {alice: {"llama": [2, 10, 20]}, bob: {"llama": [1, 1, 1]}}}, {}) == 2
    store({H0: {alice: {"llama": [1, 5, 5], "qwen": [1, 1, 0]}}, H1: {alice: {"llama": [1, 1, 1]}}}, {})
    assert rows() == {
        ("alice", "llama", H0): [3, 15, 25],
        ("alice", "qwen", H0): [1, 1, 0],
        ("alice", "llama", H1): [1, 1, 1],
        ("bob", "llama", H0): [1, 1, 1],
    }


def test_storing_runs_the_same_number_of_queries_for_one_key_and_for_many():
    def queries(keys: int) -> int:
        digests = [new_key(f"k{keys}-{i}")[1] for i in range(keys)]
        tokens = {hour: {d: {m: [1, 1, 1] for m in ("a", "b", "c")} for d in digests} for hour in (H0, H1)}
        with CaptureQueriesContext(connection) as captured:
            store(tokens, {d: H0 + 1.0 for d in digests})
        return len(captured)

    one, many = queries(1), queries(15)
    assert UPSERT_BATCH >= 15 * 3 * 2, "both sizes fit one upsert"
    assert one == many
    assert TokenUsage.objects.count() == (1 + 15) * 3 * 2


def test_last_use_moves_forward_only():
    key, digest = new_key("alice")
    store({}, {digest: H0 + 100.0})
    key.refresh_from_db()
    assert key.last_used_at == at(H0 + 100)
    store({}, {digest: H0 + 50.0})  # an older report, e.g. from a router that was cut off
    key.refresh_from_db()
    assert key.last_used_at == at(H0 + 100)
    store({}, {digest: H0 + 200.5})
    key.refresh_from_db()
    assert key.last_used_at == at(H0 + 200.5)


def test_unknown_keys_are_dropped_with_a_log_line(caplog):
    _, alice = new_key("alice")
    with caplog.at_level(logging.WARNING, logger="keys.usage"):
        assert store({H0: {alice: {"m": [1, 1, 1]}, "f" * 64: {"m": [5, 5, 5]}}}, {"e" * 64: H0}) == 1
    assert rows() == {("alice", "m", H0): [1, 1, 1]}
    assert "2 unknown API key(s)" in caplog.text


def test_a_deleted_key_keeps_its_rows_under_its_name():
    key, digest = new_key("alice")
    store({H0: {digest: {"m": [1, 2, 3]}}}, {})
    key.delete()
    row = TokenUsage.objects.get()
    assert (row.key_id, row.key_name, row.prompt_tokens) == (None, "alice", 2)


def test_counts_the_database_refuses_go_back_to_the_hub():
    _, digest = new_key("alice")
    hub = InProcessHub()
    # A negative count breaks the rows' CHECK constraint: a real refusal by the database.
    snapshot = UsageSnapshot(
        stamps={}, routers=[], tokens={H0: counted({digest: {"m": [1, -5, 0]}})}, keys={digest: H0 + 1.0}
    )
    assert record_token_usage(snapshot, hub) == 0
    assert TokenUsage.objects.count() == 0
    given_back = hub.collect_usage()
    assert given_back.tokens == {H0: counted({digest: {"m": [1, -5, 0]}})}
    assert given_back.keys == {digest: H0 + 1.0}
    assert ApiKey.objects.get().last_used_at is None  # one transaction: nothing of it was kept


@pytest.mark.parametrize("backend", ["in-process", "redis"])
def test_two_routers_report_and_ticks_store_each_count_once(backend, request, run_tick):
    key, digest = new_key("alice")
    hub = InProcessHub() if backend == "in-process" else RedisHub(request.getfixturevalue("redis_url"))

    async def routers():
        await hub.report_usage(
            UsageReport(router="a", tokens=counted({digest: {"llama": [2, 10, 20]}}), keys={digest: 100.0})
        )
        await hub.report_usage(
            UsageReport(router="b", tokens=counted({digest: {"llama": [1, 1, 1]}}), keys={digest: 200.0})
        )

    asyncio.run(routers())
    run_tick(hub=hub)
    run_tick(hub=hub)  # the counts were taken by the first tick: a second one adds nothing
    (row,) = TokenUsage.objects.all()
    assert [row.requests, row.prompt_tokens, row.completion_tokens] == [3, 11, 21]
    assert row.hour.minute == row.hour.second == 0
    key.refresh_from_db()
    assert key.last_used_at == at(200.0)


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_two_leaders_storing_at_once_add_up():
    """A paused leader and its successor may store what each took at the same moment: nothing is lost."""
    _, digest = new_key("alice")
    rounds = 25
    barrier = threading.Barrier(2)

    def leader():
        try:
            barrier.wait(5)
            for _ in range(rounds):
                store({H0: {digest: {"m": [1, 2, 3]}}}, {digest: H0 + 1.0})
        finally:
            connections.close_all()

    threads = [threading.Thread(target=leader) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert rows() == {("alice", "m", H0): [2 * rounds, 4 * rounds, 6 * rounds]}
