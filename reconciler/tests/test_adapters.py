"""The leader puts LoRA adapters on ready base replicas (reconciler.adapters): assignment by rendezvous hashing
over free slots, least-recently-used eviction when full, idle unloads, the agent's reports, and the table."""

from datetime import timedelta

import msgspec
import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from catalog.models import Adapter
from hub import UsageReport, get_hub
from hub.contracts import EndpointTable
from nodewire.adapter_messages import AdapterStatus
from nodewire.parts import ShardHeartbeat
from reconciler.adapters import _score, reconcile_held, record_adapter_stamps, record_adapter_statuses
from reconciler.choices import AdapterLoadState, ReplicaState
from reconciler.endpoints import build_endpoint_table
from reconciler.models import AdapterLoad, AdapterStats, GPUAssignment
from reconciler.outbox import Outbox
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


def _base(slots=2, idle_timeout_seconds=None, replicas=1):
    """A vLLM base model with `slots` adapter slots per replica and `replicas` READY replicas on their own nodes."""
    model = make_model(
        "llama", engine="vllm", sleep_level=0, max_adapters=slots, max_adapter_rank=16, max_replicas=replicas
    )
    profile = model.profiles.get()
    profile.idle_timeout_seconds = idle_timeout_seconds
    profile.save()
    found = []
    for i in range(replicas):
        node = make_node(f"gpu-{i}", gpus=1)
        found.append(make_replica(profile, placement=[(node, [0])], endpoint=f"http://gpu-{i}:9000"))
    return model, found


def _adapters(model, *names):
    return [Adapter.objects.create(name=name, base=model, source=f"org/{name}") for name in names]


def _ask(*names):
    for name in names:
        async_to_sync(get_hub().request_activation)(name)


def _loads(inbox):
    return [(c["type"], c["name"]) for c in inbox() if c["type"] in ("load_adapter", "unload_adapter")]


def test_an_adapter_asked_for_is_loaded_on_a_ready_replica_of_its_base_and_published_when_loaded(run_tick, agent_inbox):
    model, (replica,) = _base()
    (adapter,) = _adapters(model, "support-bot")
    inbox = agent_inbox("gpu-0")
    head = replica.shards.get()

    _ask("support-bot")
    report = run_tick()

    assert report.adapter_loads_sent == 1
    (command,) = [c for c in inbox() if c["type"] == "load_adapter"]
    assert (command["shard_id"], command["name"], command["source"]) == (head.pk, "support-bot", "org/support-bot")
    load = AdapterLoad.objects.get()
    assert (load.adapter_id, load.replica_id, load.state) == (adapter.pk, replica.pk, AdapterLoadState.LOADING)
    entry = build_endpoint_table().adapters["support-bot"]
    assert (entry.base, entry.replicas, entry.loading) == ("llama", [], True)

    # Asked again before the agent answers: one load, not two.
    _ask("support-bot")
    run_tick()
    assert _loads(inbox) == []

    assert record_adapter_statuses(
        head.node_id, [AdapterStatus(shard_id=head.pk, name="support-bot", state="loaded")], timezone.now()
    )
    entry = build_endpoint_table().adapters["support-bot"]
    assert (entry.replicas, entry.loading) == ([str(replica.pk)], False)


def test_a_report_from_another_node_changes_nothing(run_tick, agent_inbox):
    model, (replica,) = _base()
    _adapters(model, "a")
    other = make_node("elsewhere", gpus=1)
    _ask("a")
    run_tick()
    head = replica.shards.get()

    status = AdapterStatus(shard_id=head.pk, name="a", state="loaded")
    assert not record_adapter_statuses(other.pk, [status], timezone.now())
    assert AdapterLoad.objects.get().state == AdapterLoadState.LOADING


def test_a_failed_load_is_forgotten_so_the_next_ask_loads_it_again(run_tick, agent_inbox):
    model, (replica,) = _base()
    _adapters(model, "a")
    inbox = agent_inbox("gpu-0")
    _ask("a")
    run_tick()
    head = replica.shards.get()
    failed = AdapterStatus(shard_id=head.pk, name="a", state="failed", message="no such adapter")
    record_adapter_statuses(head.node_id, [failed], timezone.now())
    assert not AdapterLoad.objects.exists()
    inbox()

    _ask("a")
    run_tick()
    assert _loads(inbox) == [("load_adapter", "a")]


def test_adapters_spread_over_replicas_by_rendezvous_hashing_and_a_full_replica_passes_to_the_next(
    run_tick, agent_inbox
):
    model, replicas = _base(slots=1, replicas=2)
    names = [f"ft-{i}" for i in range(2)]
    _adapters(model, *names)
    _ask(*names)
    run_tick()

    placed = dict(AdapterLoad.objects.values_list("adapter__name", "replica_id"))
    # One slot each: the two adapters take one replica each, whatever the hash prefers.
    assert sorted(placed.values()) == sorted(r.pk for r in replicas)
    # The first adapter (by name) got its rendezvous favourite.
    favourite = max(replicas, key=lambda r: _score("ft-0", r.pk))
    assert placed["ft-0"] == favourite.pk


def test_a_full_replica_unloads_its_least_recently_used_adapter_first(run_tick, agent_inbox):
    model, (replica,) = _base(slots=2)
    old, recent, new = _adapters(model, "old", "recent", "new")
    now = timezone.now()
    for adapter, used in ((old, now - timedelta(minutes=10)), (recent, now - timedelta(seconds=5))):
        AdapterLoad.objects.create(
            adapter=adapter, replica=replica, state=AdapterLoadState.LOADED, requested_at=now, loaded_at=now,
            last_used=used,
        )  # fmt: skip
    inbox = agent_inbox("gpu-0")

    _ask("new")
    run_tick()

    # The unload goes first: the agent runs a shard's adapter commands in order, so the slot is free for the load.
    assert _loads(inbox) == [("unload_adapter", "old"), ("load_adapter", "new")]
    states = dict(AdapterLoad.objects.values_list("adapter__name", "state"))
    assert states == {"old": "unloading", "recent": "loaded", "new": "loading"}
    # Only loaded adapters are published; the one going away is not.
    assert build_endpoint_table().adapters["old"].replicas == []
    head = replica.shards.get()
    record_adapter_statuses(head.node_id, [AdapterStatus(shard_id=head.pk, name="old", state="unloaded")], now)
    assert not AdapterLoad.objects.filter(adapter=old).exists()


def test_nothing_loads_onto_a_replica_that_is_not_ready(run_tick, agent_inbox):
    model, (replica,) = _base()
    _adapters(model, "a")
    for state in (ReplicaState.SLEEPING, ReplicaState.WAKING, ReplicaState.STOPPING):
        replica.state = state
        replica.save(update_fields=["state"])
        _ask("a")
        run_tick()
        assert not AdapterLoad.objects.exists(), state


def test_an_adapter_of_a_base_with_no_replica_starts_the_base(run_tick, agent_inbox):
    model = make_model("llama", engine="vllm", sleep_level=0, max_adapters=4, min_replicas=0)
    make_node("gpu-a", gpus=1)
    _adapters(model, "a")
    inbox = agent_inbox("gpu-a")

    _ask("a")
    report = run_tick()

    assert report.replicas_created == 1 and report.unknown_activations == []
    assert [c["model"] for c in inbox() if c["type"] == "start_shard"] == ["llama"]


def test_a_disabled_adapter_is_an_unknown_activation(run_tick):
    model, _ = _base()
    (adapter,) = _adapters(model, "a")
    adapter.enabled = False
    adapter.save()
    _ask("a")
    assert run_tick().unknown_activations == ["a"]
    assert "a" not in build_endpoint_table().adapters


def test_an_adapter_idle_past_its_base_profile_idle_timeout_is_unloaded(run_tick, agent_inbox, usage_known):
    model, (replica,) = _base(idle_timeout_seconds=60)
    idle, busy = _adapters(model, "idle", "busy")
    now = timezone.now()
    for adapter, used in ((idle, now - timedelta(minutes=5)), (busy, now - timedelta(seconds=5))):
        AdapterLoad.objects.create(
            adapter=adapter, replica=replica, state="loaded", requested_at=now, loaded_at=now - timedelta(hours=1),
            last_used=used,
        )  # fmt: skip
    inbox = agent_inbox("gpu-0")

    report = run_tick()

    assert report.adapter_unloads_sent == 1
    assert _loads(inbox) == [("unload_adapter", "idle")]


def test_idle_adapters_stay_while_usage_is_unknown(run_tick, agent_inbox):
    model, (replica,) = _base(idle_timeout_seconds=60)
    (adapter,) = _adapters(model, "idle")
    long_ago = timezone.now() - timedelta(hours=1)
    AdapterLoad.objects.create(
        adapter=adapter, replica=replica, state="loaded", requested_at=long_ago, loaded_at=long_ago
    )

    assert run_tick().adapter_unloads_sent == 0  # DESIGN invariant 3: unknown is not idle


def test_routers_stamps_of_adapters_become_their_last_use(run_tick):
    model, (replica,) = _base()
    (adapter,) = _adapters(model, "a")
    now = timezone.now()
    AdapterLoad.objects.create(adapter=adapter, replica=replica, state="loaded", requested_at=now, loaded_at=now)
    used = now.timestamp() + 5

    assert record_adapter_stamps({str(replica.pk): used, f"{replica.pk}/a": used, "junk/": 1.0, "x/a": 1.0}) == 1
    assert AdapterLoad.objects.get().last_used.timestamp() == pytest.approx(used)


def test_a_heartbeat_corrects_what_the_rows_say_an_engine_holds(run_tick):
    model, (replica,) = _base(slots=4)
    lost, late = _adapters(model, "lost", "late")
    now = timezone.now()
    AdapterLoad.objects.create(adapter=lost, replica=replica, state="loaded", requested_at=now, loaded_at=now)
    AdapterLoad.objects.create(adapter=late, replica=replica, state="loading", requested_at=now)
    head = replica.shards.get()

    # The engine restarted and lost "lost"; "late" was loaded but its report went missing.
    beat = [ShardHeartbeat(shard_id=head.pk, state="ready", adapters=["late"])]
    assert reconcile_held(head.node_id, "gpu-0", beat, Outbox(1)) == 2
    assert dict(AdapterLoad.objects.values_list("adapter__name", "state")) == {"late": "loaded"}
    # An engine without adapter slots lists none: nothing to correct, and no query.
    assert reconcile_held(head.node_id, "gpu-0", [ShardHeartbeat(shard_id=head.pk, state="ready")], Outbox(1)) == 0


def test_an_adapter_an_engine_holds_that_no_load_backs_is_unloaded(run_tick, agent_inbox):
    model, (replica,) = _base(slots=4)
    (kept,) = _adapters(model, "kept")
    _loaded(kept, replica)
    head = replica.shards.get()
    outbox = Outbox(1)

    # "gone" was deleted from the catalog while loaded: its row went with it, the engine still holds it.
    beat = [ShardHeartbeat(shard_id=head.pk, state="ready", adapters=["gone", "kept"])]
    reconcile_held(head.node_id, "gpu-0", beat, outbox)

    assert [(type(command).__name__, command.name) for _, command in outbox.commands] == [("UnloadAdapter", "gone")]


def test_the_loads_of_a_replica_that_failed_are_forgotten(run_tick):
    model, (replica,) = _base()
    (adapter,) = _adapters(model, "a")
    now = timezone.now()
    AdapterLoad.objects.create(adapter=adapter, replica=replica, state="loaded", requested_at=now, loaded_at=now)
    replica.state = ReplicaState.FAILED
    replica.save(update_fields=["state"])

    run_tick()

    assert not AdapterLoad.objects.exists()


def test_a_load_never_answered_is_forgotten_after_the_timeout_and_asked_again(run_tick, agent_inbox, settings):
    settings.LLMGW_ADAPTER_LOAD_TIMEOUT_SECONDS = 30
    model, (replica,) = _base()
    (adapter,) = _adapters(model, "a")
    AdapterLoad.objects.create(adapter=adapter, replica=replica, requested_at=timezone.now() - timedelta(minutes=1))
    inbox = agent_inbox("gpu-0")

    _ask("a")
    run_tick()

    assert _loads(inbox) == [("load_adapter", "a")]
    assert AdapterLoad.objects.get().requested_at > timezone.now() - timedelta(seconds=30)


@pytest.mark.parametrize("count", [1, 50])
def test_the_table_with_adapters_is_built_in_six_queries_whatever_their_number(count, django_assert_num_queries):
    model, (replica,) = _base(slots=count)
    adapters = _adapters(model, *(f"ft-{i}" for i in range(count)))
    now = timezone.now()
    AdapterLoad.objects.bulk_create(
        AdapterLoad(adapter=a, replica=replica, state="loaded", requested_at=now, loaded_at=now) for a in adapters
    )
    with django_assert_num_queries(6):
        table = build_endpoint_table()
    assert len(table.adapters) == count
    assert all(entry.replicas == [str(replica.pk)] for entry in table.adapters.values())


def test_an_adapter_added_or_removed_is_published_when_it_commits(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        model, _ = _base()
    hub = get_hub()
    with django_capture_on_commit_callbacks(execute=True):
        (adapter,) = _adapters(model, "fresh")
    assert "fresh" in msgspec.json.decode(async_to_sync(hub.read_endpoints)(), type=EndpointTable).adapters

    with django_capture_on_commit_callbacks(execute=True):
        adapter.delete()
    assert "fresh" not in msgspec.json.decode(async_to_sync(hub.read_endpoints)(), type=EndpointTable).adapters


def test_a_disabled_adapter_is_unloaded_even_while_usage_is_unknown(run_tick, agent_inbox):
    model, (replica,) = _base()
    (adapter,) = _adapters(model, "a")
    now = timezone.now()
    AdapterLoad.objects.create(
        adapter=adapter, replica=replica, state="loaded", requested_at=now, loaded_at=now, last_used=now
    )
    inbox = agent_inbox("gpu-0")
    adapter.enabled = False
    adapter.save()

    assert run_tick().adapter_unloads_sent == 1
    assert _loads(inbox) == [("unload_adapter", "a")]


def test_answered_loads_and_failures_are_counted_per_base_with_the_learned_load_time(run_tick, agent_inbox):
    model, (replica,) = _base(slots=4)
    _adapters(model, "a", "b", "c")
    _ask("a", "b", "c")
    run_tick()
    head = replica.shards.get()
    now = timezone.now()

    record_adapter_statuses(
        head.node_id,
        [
            AdapterStatus(shard_id=head.pk, name="a", state="loaded", seconds=2.0),
            AdapterStatus(shard_id=head.pk, name="b", state="loaded", seconds=4.0),
            AdapterStatus(shard_id=head.pk, name="c", state="failed", message="no such adapter"),
            AdapterStatus(shard_id=head.pk, name="c", state="failed", message="a repeat: nothing was loading"),
        ],
        now,
    )

    stats = AdapterStats.objects.get(model=model)
    assert (stats.loads, stats.failures, stats.load_seconds) == (2, 1, 3.0)  # half old, half new


def _loaded(adapter, replica):
    now = timezone.now()
    return AdapterLoad.objects.create(adapter=adapter, replica=replica, state="loaded", requested_at=now, loaded_at=now)


def _report_in_flight(counts):
    async_to_sync(get_hub().report_usage)(UsageReport(router="test-router", ttl=3600, in_flight=counts))


def test_a_busy_adapter_is_spread_to_one_more_replica_with_a_free_slot(run_tick, agent_inbox):
    model, replicas = _base(slots=2, replicas=3)
    model.profiles.update(target_concurrency=2)
    (adapter,) = _adapters(model, "hot")
    home = max(replicas, key=lambda r: _score("hot", r.pk))
    _loaded(adapter, home)

    _report_in_flight({"llama": 2, "hot": 2})  # at its holder's target: no more replicas
    assert run_tick().adapter_loads_sent == 0
    _report_in_flight({"llama": 3, "hot": 3})  # above it: the next replica in rendezvous order takes it
    assert run_tick().adapter_loads_sent == 1
    second = max((r for r in replicas if r != home), key=lambda r: _score("hot", r.pk))
    assert set(AdapterLoad.objects.values_list("replica_id", flat=True)) == {home.pk, second.pk}
    # While that load is under way, nothing more, however busy.
    _report_in_flight({"llama": 9, "hot": 9})
    assert run_tick().adapter_loads_sent == 0


def test_spreading_never_unloads_another_adapter(run_tick, agent_inbox):
    model, (first, second) = _base(slots=1, replicas=2)
    model.profiles.update(target_concurrency=1)
    hot, other = _adapters(model, "hot", "other")
    _loaded(hot, first)
    _loaded(other, second)

    _report_in_flight({"hot": 5})
    assert run_tick().adapter_loads_sent == 0
    assert dict(AdapterLoad.objects.values_list("adapter__name", "state")) == {"hot": "loaded", "other": "loaded"}


def test_the_table_lists_an_adapters_aliases_sorted():
    model, _ = _base()
    Adapter.objects.create(name="a", base=model, source="org/a", aliases=["zed", "alpha"])
    Adapter.objects.create(name="b", base=model, source="org/b")
    adapters = build_endpoint_table().adapters
    assert (adapters["a"].aliases, adapters["b"].aliases) == (["alpha", "zed"], [])


def test_when_every_slot_is_taken_the_least_recently_used_over_all_replicas_goes_unless_in_flight(
    run_tick, agent_inbox
):
    model, (first, second) = _base(slots=1, replicas=2)
    old, older, new = _adapters(model, "old", "older", "new")
    now = timezone.now()
    for adapter, replica, ago in ((old, first, 60), (older, second, 600)):
        AdapterLoad.objects.create(
            adapter=adapter, replica=replica, state="loaded", requested_at=now, loaded_at=now,
            last_used=now - timedelta(seconds=ago),
        )  # fmt: skip
    inbox = agent_inbox("gpu-1")

    # "older" is in flight by the routers' last report (its stamp has not come yet): "old" goes instead.
    _report_in_flight({"older": 1})
    _ask("new")
    run_tick()
    assert dict(AdapterLoad.objects.values_list("adapter__name", "state")) == {
        "old": "unloading", "older": "loaded", "new": "loading",
    }  # fmt: skip
    assert inbox() == []  # not on the second replica's node


def test_an_adapter_of_a_sleeping_base_wakes_the_base_first(run_tick, agent_inbox):
    model, (replica,) = _base()
    _adapters(model, "a")
    replica.state = ReplicaState.SLEEPING
    replica.save(update_fields=["state"])
    replica.shards.update(state="sleeping")
    GPUAssignment.objects.filter(shard__replica=replica).update(awake=False)
    inbox = agent_inbox("gpu-0")

    _ask("a")
    report = run_tick()

    assert report.replicas_woken == 1 and report.adapter_loads_sent == 0  # loaded once it is ready again
    assert [c["type"] for c in inbox()] == ["wake_shard"]
