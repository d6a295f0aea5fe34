"""The hub's contract, run against both backends: in-process and the real Redis."""

import asyncio
import contextlib
import re

import msgspec
import pytest
import redis

from hub import InProcessHub, RedisHub, fingerprint
from hub.contracts import (
    Activation,
    EndpointRow,
    EndpointTable,
    ModelEntry,
    RouterMark,
    TokenCount,
    UsageReport,
    UsageSnapshot,
    decode_activation,
    encode_activation,
)
from hub.redis_hub import ACTIVATIONS_KEY, ROUTERS_KEY
from hub.windows import FIRST_TOKEN_BUCKETS, ModelWindow


@pytest.fixture(params=["in-process", "redis"])
def hub(request):
    if request.param == "in-process":
        return InProcessHub()
    return RedisHub(request.getfixturevalue("redis_url"))


class FakeClock:
    """Unix time that moves only when a test says so."""

    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["in-process", "redis"])
def clocked_hub(request):
    """Either hub, with a clock the test moves."""
    clock = FakeClock()
    if request.param == "in-process":
        return InProcessHub(clock=clock), clock
    return RedisHub(request.getfixturevalue("redis_url"), clock=clock), clock


def run(coro):
    return asyncio.run(coro)


TABLE = EndpointTable(models={"llama": ModelEntry(aliases=["l"])})


def test_an_endpoint_table_is_published_only_when_it_changes(hub):
    """DESIGN invariant 7."""
    assert hub.publish_endpoints(TABLE) is True
    assert hub.publish_endpoints(msgspec.structs.replace(TABLE)) is False
    changed = msgspec.structs.replace(
        TABLE, endpoints=[EndpointRow(replica_id="1", model="llama", url="http://127.0.0.1:1")]
    )
    assert hub.publish_endpoints(changed) is True
    published = msgspec.json.decode(run(hub.read_endpoints()), type=EndpointTable)
    assert published.fingerprint == fingerprint(changed)
    assert published.endpoints == changed.endpoints


def test_a_table_built_again_alike_is_not_published_again(hub):
    """DESIGN invariant 7: the fingerprint is of the content, whatever order the models were added in."""
    first = EndpointTable(models={"a": ModelEntry(), "b": ModelEntry(aliases=["x"], start_seconds=12.5)})
    again = EndpointTable(models={"b": ModelEntry(aliases=["x"], start_seconds=12.5), "a": ModelEntry()})
    assert hub.publish_endpoints(first) is True
    assert hub.publish_endpoints(again) is False
    assert hub.publish_endpoints(EndpointTable(models={"a": ModelEntry(unplaceable="no room")})) is True


def test_a_published_table_reaches_a_watching_router(hub):
    async def watch_one():
        watching = hub.watch_endpoints()
        first = asyncio.ensure_future(anext(watching))
        await asyncio.sleep(0.2)  # subscribed before the publish
        await asyncio.to_thread(hub.publish_endpoints, TABLE)
        try:
            return await asyncio.wait_for(first, 5)
        finally:
            await watching.aclose()

    received = msgspec.json.decode(run(watch_one()), type=EndpointTable)
    assert received.models == TABLE.models
    assert received.fingerprint == fingerprint(TABLE)


def test_fleets_on_two_databases_of_one_redis_never_hear_each_others_tables_or_key_changes(redis_url):
    """Pub/sub belongs to the whole server: a fleet on another database must not receive this one's messages."""
    base, _, db = redis_url.rpartition("/")
    here, there = RedisHub(redis_url), RedisHub(f"{base}/{(int(db) + 1) % 16}")
    assert here.endpoints_channel != there.endpoints_channel
    assert here.key_changes_channel != there.key_changes_channel

    async def listen():
        tables, changes = here.watch_endpoints(), here.watch_key_changes()
        table, change = asyncio.ensure_future(anext(tables)), asyncio.ensure_future(anext(changes))
        await asyncio.sleep(0.2)  # both subscribed
        await asyncio.to_thread(there.publish_endpoints, EndpointTable(models={"elsewhere": ModelEntry()}))
        await asyncio.to_thread(there.publish_key_changes, ["elsewhere"])
        await asyncio.sleep(0.5)
        heard_nothing = not table.done() and not change.done()
        await asyncio.to_thread(here.publish_key_changes, ["here"])
        async with asyncio.timeout(2):
            heard = await change
        table.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await table
        await changes.aclose()
        return heard_nothing, heard

    try:
        assert run(listen()) == (True, ["here"])
    finally:
        there._sync.delete("llmgw:endpoints")


def test_activations_are_drained_once_however_often_asked(hub):
    async def ask():
        await asyncio.gather(*(hub.request_activation("llama") for _ in range(5)), hub.request_activation("qwen"))

    run(ask())
    assert hub.drain_activations() == {Activation(model="llama"), Activation(model="qwen")}
    assert hub.drain_activations() == set()


def test_an_activation_carries_the_asking_keys_pools_and_one_per_model_and_pools_is_drained(hub):
    async def ask():
        await hub.request_activation("llama", ["silver", "gold"])
        await hub.request_activation("llama", ("gold", "silver", "gold"))  # the same pools in another order
        await hub.request_activation("llama", {"gold"})
        await hub.request_activation("llama")

    run(ask())
    assert hub.drain_activations() == {
        Activation(model="llama", pools=("gold", "silver")),
        Activation(model="llama", pools=("gold",)),
        Activation(model="llama"),
    }
    assert hub.drain_activations() == set()


def test_an_activation_without_pools_is_stored_as_the_bare_model_name_every_control_plane_reads(redis_url):
    hub = RedisHub(redis_url)
    run(hub.request_activation("llama"))
    run(hub.request_activation("qwen", ["gold"]))
    stored = redis.Redis.from_url(redis_url).smembers(ACTIVATIONS_KEY)
    assert stored == {b"llama", b'{"model":"qwen","pools":["gold"]}'}


def test_a_malformed_activation_is_skipped_and_logged_and_the_others_are_drained(redis_url, caplog):
    redis.Redis.from_url(redis_url).sadd(
        ACTIVATIONS_KEY, b"llama", b'{"model":"qwen","pools":["gold"]}', b'{"model":"qwen","pools":[""]}', b"{nope", b""
    )
    assert RedisHub(redis_url).drain_activations() == {
        Activation(model="llama"),
        Activation(model="qwen", pools=("gold",)),
    }
    assert caplog.text.count("skipping a malformed activation") == 3


def test_an_activation_is_decoded_as_it_was_encoded():
    for activation in (Activation(model="llama"), Activation(model="org/model:v1", pools=("a", "b"))):
        assert decode_activation(encode_activation(activation)) == activation
    assert Activation.of("m", ["b", "a", "b"]) == Activation(model="m", pools=("a", "b"))


def test_usage_keeps_the_newest_stamp_and_forgets_on_request(hub):
    """DESIGN invariant 4: newest wins, whatever order routers flush in."""
    run(hub.report_usage(UsageReport(router="a", stamps={"1": 200.0, "2": 50.0})))
    run(hub.report_usage(UsageReport(router="b", stamps={"1": 100.0, "2": 60.0})))
    assert hub.collect_usage().stamps == {"1": 200.0, "2": 60.0}
    hub.forget_usage(["2"])
    assert hub.collect_usage().stamps == {"1": 200.0}


def marks(hub) -> dict[str, RouterMark]:
    return {mark.router: mark for mark in hub.collect_usage().routers}


def test_each_router_has_its_own_mark_kept_while_renewed_and_restarted_after_a_lapse(clocked_hub):
    hub, clock = clocked_hub
    assert hub.collect_usage() == UsageSnapshot(stamps={}, routers=[])
    start = clock.now
    run(hub.report_usage(UsageReport(router="a", ttl=1.0)))
    clock.now += 0.5
    run(hub.report_usage(UsageReport(router="b", ttl=1.0)))
    clock.now += 0.4
    run(hub.report_usage(UsageReport(router="a", ttl=1.0)))
    assert marks(hub)["a"] == RouterMark(router="a", since=start, renewed=start + 0.9, ttl=1.0)
    clock.now += 0.9
    run(hub.report_usage(UsageReport(router="a", ttl=1.0)))
    assert marks(hub)["a"].since == start  # renewed within its ttl: the same unbroken watch
    assert marks(hub)["b"].lapsed(clock.now)  # b went quiet; a renewing does not hide it
    clock.now += 1.5
    run(hub.report_usage(UsageReport(router="a", ttl=1.0)))
    run(hub.report_usage(UsageReport(router="b", ttl=1.0)))
    # a's last flush was 1.5 s ago, past its 1 s ttl: what it did in the gap is unknown, its watch restarts.
    assert marks(hub)["a"] == RouterMark(router="a", since=clock.now, renewed=clock.now, ttl=1.0)
    assert marks(hub)["b"].since == clock.now


def test_a_mark_carries_the_routers_last_in_flight_peaks(clocked_hub):
    hub, _ = clocked_hub
    run(hub.report_usage(UsageReport(router="a", in_flight={"llama": 3, "qwen": 1})))
    run(hub.report_usage(UsageReport(router="b", in_flight={"llama": 2})))
    run(hub.report_usage(UsageReport(router="a", in_flight={"llama": 4})))
    assert {name: mark.in_flight for name, mark in marks(hub).items()} == {"a": {"llama": 4}, "b": {"llama": 2}}


def test_a_mark_carries_the_routers_last_windows(clocked_hub):
    hub, _ = clocked_hub
    ttft = [0] * (len(FIRST_TOKEN_BUCKETS) + 1)
    ttft[3] = 40
    window = ModelWindow(ttft=ttft, waiting={"batch": 2}, served={"red": 1200})
    run(hub.report_usage(UsageReport(router="a", windows={"llama": ModelWindow(served={"red": 1})})))
    run(hub.report_usage(UsageReport(router="a", windows={"llama": window})))
    assert marks(hub)["a"].windows == {"llama": window}  # replaced by each report, like the peaks


def test_a_router_leaving_or_forgotten_loses_its_mark_and_the_stamps_stay(clocked_hub):
    hub, _ = clocked_hub
    for router in ("a", "b", "c"):
        run(hub.report_usage(UsageReport(router=router, stamps={router: 1.0})))
    run(hub.leave("a"))
    hub.forget_routers(["b", "never-seen"])
    hub.forget_routers([])
    assert list(marks(hub)) == ["c"]
    assert hub.collect_usage().stamps == {"a": 1.0, "b": 1.0, "c": 1.0}


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"router": ""}, "length >= 1 - at `$.router`"),
        ({"ttl": 0}, "> 0.0 - at `$.ttl`"),
        ({"ttl": float("nan")}, "> 0.0 - at `$.ttl`"),
        ({"ttl": float("inf")}, "<= 86400.0 - at `$.ttl`"),
        ({"in_flight": {"llama": -1}}, ">= 0 - at `$.in_flight[...]`"),
        ({"in_flight": {"llama": 1.5}}, "Expected `int`, got `float` - at `$.in_flight[...]`"),
        ({"windows": {"llama": ModelWindow(served={"red": -1})}}, ">= 0 - at `$.windows[...].served[...]`"),
    ],
)
def test_a_malformed_usage_report_is_refused_naming_the_problem(hub, fields, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        run(hub.report_usage(UsageReport(**{"router": "a", "stamps": {"1": 5.0}, **fields})))
    assert hub.collect_usage() == UsageSnapshot(stamps={}, routers=[])


def test_redis_writes_the_stamps_before_the_mark_in_one_transaction(redis_url):
    """A mark seen renewed vouches for stamps written before it (UsageSnapshot): MULTI, ZADD, then the mark."""
    client = redis.Redis.from_url(redis_url)
    database = client.connection_pool.connection_kwargs.get("db", 0)
    with client.monitor() as monitor:
        hub = RedisHub(redis_url)
        run(hub.report_usage(UsageReport(router="a", stamps={"1": 10.0}, in_flight={"llama": 1})))
        commands = []
        while not commands or commands[-1] != "EXEC":
            seen = monitor.next_command()
            command = seen["command"].split()[0].upper()
            # The server's every command: only this test's database (other tests may run beside it).
            if seen["db"] == database and command in ("MULTI", "ZADD", "EVAL", "EXEC"):
                commands.append(command)
    assert commands == ["MULTI", "ZADD", "EVAL", "EXEC"]
    assert marks(hub)["a"].in_flight == {"llama": 1}
    client.close()


def test_redis_collects_marks_then_stamps_and_takes_tokens_in_one_transaction(redis_url):
    client = redis.Redis.from_url(redis_url)
    hub = RedisHub(redis_url)
    run(hub.report_usage(UsageReport(router="a", stamps={"1": 10.0})))
    database = client.connection_pool.connection_kwargs.get("db", 0)
    with client.monitor() as monitor:
        snapshot = hub.collect_usage()
        commands = []
        while not commands or commands[-1] != "EXEC":
            seen = monitor.next_command()
            command = seen["command"].split()[0].upper()
            # The server's every command: only this test's database (other tests may run beside it).
            if seen["db"] == database and command in ("MULTI", "HGETALL", "ZRANGE", "DEL", "EXEC"):
                commands.append(command)
    # Marks, stamps, then token counters, keys' last use and continuation counters read and deleted: one MULTI.
    assert commands == ["MULTI", "HGETALL", "ZRANGE", "HGETALL", "ZRANGE", "HGETALL", "DEL", "EXEC"]
    assert snapshot.stamps == {"1": 10.0} and [m.router for m in snapshot.routers] == ["a"]
    client.close()


def test_redis_skips_a_malformed_mark_and_reads_the_others(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.hset(ROUTERS_KEY, "broken", "not json")
    hub = RedisHub(redis_url)
    run(hub.report_usage(UsageReport(router="a")))
    assert list(marks(hub)) == ["a"]
    run(hub.report_usage(UsageReport(router="broken")))  # its next report rewrites it
    assert sorted(marks(hub)) == ["a", "broken"]
    client.close()


def test_concurrent_reports_of_many_routers_each_keep_their_own_mark(redis_url):
    """The mark's read-modify-write is one script: concurrent flushes never lose a router's mark."""
    hub = RedisHub(redis_url)

    async def flush_all():
        for _ in range(5):
            await asyncio.gather(
                *(hub.report_usage(UsageReport(router=f"r{i}", stamps={str(i): float(i)})) for i in range(20))
            )

    run(flush_all())
    assert sorted(marks(hub)) == sorted(f"r{i}" for i in range(20))
    assert len(hub.collect_usage().stamps) == 20


def test_an_activation_request_calls_the_in_process_listeners():
    hub, calls = InProcessHub(), []
    hub.on_activation(lambda: calls.append("woken"))
    run(hub.request_activation("llama"))
    assert calls == ["woken"]
    assert hub.drain_activations() == {Activation(model="llama")}


def test_key_changes_reach_every_watcher_published_after_it_subscribed(hub):
    async def scenario():
        first, second = hub.watch_key_changes(), hub.watch_key_changes()
        heard_first = asyncio.ensure_future(anext(first))
        heard_second = asyncio.ensure_future(anext(second))
        await asyncio.sleep(0.2)  # both subscribed
        await asyncio.get_running_loop().run_in_executor(None, hub.publish_key_changes, ["abc", "def"])
        async with asyncio.timeout(2):
            return await heard_first, await heard_second

    assert run(scenario()) == (["abc", "def"], ["abc", "def"])


def test_redis_ignores_a_malformed_key_change_and_passes_the_next(redis_url):
    hub = RedisHub(redis_url)

    async def scenario():
        changes = hub.watch_key_changes()
        heard = asyncio.ensure_future(anext(changes))
        await asyncio.sleep(0.2)
        publisher = redis.Redis.from_url(redis_url)
        publisher.publish(hub.key_changes_channel, b"not json")
        publisher.publish(hub.key_changes_channel, b'{"not": "a list"}')
        hub.publish_key_changes(["abc"])
        async with asyncio.timeout(2):
            return await heard

    assert run(scenario()) == ["abc"]


def test_the_hub_contracts_are_built_by_field_name_so_their_order_is_no_part_of_the_wire():
    # A positional construction would tie every writer to the fields' order; the encoding stays as it was.
    counts, row = (1, 2, 3), ("1", "m", "http://h:1")
    with pytest.raises(TypeError):
        TokenCount(*counts)
    with pytest.raises(TypeError):
        EndpointRow(*row)
    assert msgspec.json.encode(TokenCount(requests=1, prompt=2, completion=3, spend=4)) == b"[1,2,3,4]"
    # An older router's counts carry no spend; an older hub reading ours takes the first three.
    assert msgspec.json.decode(b"[1,2,3]", type=TokenCount) == TokenCount(requests=1, prompt=2, completion=3)
