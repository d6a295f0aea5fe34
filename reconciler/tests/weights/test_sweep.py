"""The leader's sweep removes weights no profile uses once unused past the grace period, in a few queries."""

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from catalog.models import Adapter, Model, Profile
from inventory.models import Weights
from inventory.services import record_weights_status
from nodewire.protocol import WeightsStatus
from reconciler.commands import acknowledge
from reconciler.models import PendingCommand
from reconciler.outbox import Outbox
from reconciler.weights.sweep import sweep_unused_weights
from tests.fleet import make_model, make_node

pytestmark = pytest.mark.django_db

DAY = timedelta(days=1)


def hold(node, source, path=None, seen_at=None, unused_since=None):
    """Weights on `node`, first reported a month ago unless `seen_at` says otherwise."""
    path = path or f"/w/hub/models--{source.replace('/', '--')}"
    seen_at = seen_at or timezone.now() - 30 * DAY
    return Weights.objects.create(
        node=node, source=source, path=path, size_bytes=1, seen_at=seen_at, unused_since=unused_since
    )


def sweep(now, epoch=1):
    """One sweep as the tick runs it, committed; returns the (node, source) pairs it sent remove_weights to."""
    outbox = Outbox(epoch, now)
    with transaction.atomic():
        sweep_unused_weights(now, outbox)
        outbox.send_on_commit()
    return sorted((node, command.source) for node, command in outbox.commands)


def test_unused_weights_are_removed_only_past_the_grace_period_and_used_ones_never(settings):
    settings.LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS = DAY.total_seconds()
    a, b = make_node("gpu-a", gpus=0), make_node("gpu-b", gpus=0)
    make_model("llama", min_replicas=0)
    hold(a, "org/llama")
    hold(a, "org/stale")
    hold(b, "org/stale")
    now = timezone.now()
    # Found unused now: the grace counts from here, however old the files are.
    assert sweep(now) == []
    assert set(Weights.objects.values_list("source", "unused_since")) == {("org/llama", None), ("org/stale", now)}
    assert sweep(now + DAY - timedelta(seconds=1)) == []
    assert sweep(now + DAY) == [("gpu-a", "org/stale"), ("gpu-b", "org/stale")]
    pending = set(PendingCommand.objects.values_list("node_name", "shard_id", "subject", "kind"))
    assert pending == {(n, 0, "weights:org/stale", "remove_weights") for n in ("gpu-a", "gpu-b")}
    # Pending, so not sent again by the sweep (the resend step does that); the rows stay until the agents answer.
    assert sweep(now + 3 * DAY) == []
    assert Weights.objects.count() == 3


def test_weights_a_profile_uses_again_within_the_grace_period_start_it_over(settings):
    settings.LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS = DAY.total_seconds()
    a = make_node("gpu-a", gpus=0)
    hold(a, "org/later")
    now = timezone.now()
    assert sweep(now) == []
    model = make_model("later", min_replicas=0)  # added within the grace period: its weights are kept
    assert sweep(now + DAY / 2) == [] and Weights.objects.get().unused_since is None
    assert sweep(now + 2 * DAY) == []
    Model.objects.filter(pk=model.pk).update(source="org/renamed")  # its source edited away
    assert sweep(now + 3 * DAY) == []
    assert sweep(now + 4 * DAY) == [("gpu-a", "org/later")]


def test_weights_changed_on_disk_wait_a_grace_period_from_the_change(settings):
    """A download in progress changes size: it is not taken for abandoned weights."""
    settings.LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS = DAY.total_seconds()
    now = timezone.now()
    hold(make_node("gpu-a", gpus=0), "org/growing", seen_at=now, unused_since=now - 2 * DAY)
    assert sweep(now) == []
    assert sweep(now + DAY) == [("gpu-a", "org/growing")]


def test_the_key_rule_keeps_gguf_files_a_profile_names_by_relative_or_absolute_path(settings):
    settings.LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS = 0
    a = make_node("gpu-a", gpus=0)
    for name, source in (("rel", "models//rel.gguf"), ("abs", "/data/models/abs.gguf")):
        model = Model.objects.create(name=name, source=source)
        Profile.objects.create(model=model, gpu_class="H100-80GB", engine="llamacpp")
    hold(a, "models/rel.gguf", path="/data/models/rel.gguf")
    hold(a, "models/abs.gguf", path="/data/models/abs.gguf")
    hold(a, "models/other.gguf", path="/data/models/other.gguf")
    # A grace of 0: removed by the first sweep that finds them unused.
    assert sweep(timezone.now()) == [("gpu-a", "models/other.gguf")]


def test_one_sweep_sends_at_most_the_batch_oldest_unused_first(settings):
    settings.LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS = DAY.total_seconds()
    settings.LLMGW_WEIGHTS_SWEEP_BATCH = 2
    a = make_node("gpu-a", gpus=0)
    now = timezone.now()
    for i, age in enumerate((2, 5, 3)):
        hold(a, f"org/m{i}", unused_since=now - age * DAY)
    assert sweep(now) == [("gpu-a", "org/m1"), ("gpu-a", "org/m2")]
    assert sweep(now) == [("gpu-a", "org/m0")]


def test_a_removal_that_did_not_take_is_tried_again_a_grace_period_later_not_every_sweep(settings):
    settings.LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS = DAY.total_seconds()
    a = make_node("gpu-a", gpus=0)
    now = timezone.now()
    row = hold(a, "org/odd", unused_since=now - 2 * DAY)
    assert sweep(now) == [("gpu-a", "org/odd")]
    assert acknowledge("gpu-a", PendingCommand.objects.get().cid)
    status = WeightsStatus(source="org/odd", path=row.path, removed=False, message="refused: a symlink on the way")
    assert not record_weights_status(a, status)
    assert sweep(now + DAY / 2) == []
    assert sweep(now + DAY) == [("gpu-a", "org/odd")]


@pytest.mark.parametrize("nodes", [2, 20])
def test_a_sweep_costs_the_same_queries_for_2_or_20_nodes(nodes, settings, django_assert_num_queries):
    settings.LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS = DAY.total_seconds()
    make_model("llama", min_replicas=0)
    now = timezone.now()
    for i in range(nodes):
        node = make_node(f"gpu-{i:02d}", gpus=0)
        hold(node, "org/llama")
        hold(node, "org/new")  # unused from now on
        hold(node, "org/old", unused_since=now - DAY)
        hold(node, "org/back", unused_since=now - DAY / 2)  # used again from now on
    make_model("back", min_replicas=0)
    with transaction.atomic(), django_assert_num_queries(8):
        # The profiles' keys; the running engines' sources; the rows (paths are compared in Python); used again
        # cleared; newly unused marked; the due ones; their grace started again; (the outbox) the pending rows.
        outbox = Outbox(1, now)
        assert sweep_unused_weights(now, outbox) == nodes
        outbox.send_on_commit()
    assert set(Weights.objects.filter(unused_since=None).values_list("source", flat=True)) == {"org/llama", "org/back"}


def test_the_tick_sweeps_every_interval_the_first_an_interval_after_the_leaders_first_tick(
    run_tick, leader, agent_inbox, settings
):
    settings.LLMGW_WEIGHTS_SWEEP_SECONDS = 600
    settings.LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS = 0
    hold(make_node("gpu-a", gpus=0), "org/stale")
    inbox = agent_inbox("gpu-a")
    now = timezone.now()
    assert not run_tick(now=now).weights_swept
    assert not run_tick(now=now + timedelta(seconds=599)).weights_swept
    report = run_tick(now=now + timedelta(seconds=600))
    assert report.weights_swept and report.weights_removals_sent == 1
    (command,) = inbox()
    assert command == {
        "type": "remove_weights",
        "v": 1,
        "epoch": leader.epoch,
        "source": "org/stale",
        "path": "/w/hub/models--org--stale",
    }
    assert PendingCommand.objects.get().kind == "remove_weights"
    assert not run_tick(now=now + timedelta(seconds=1199)).weights_swept
    assert run_tick(now=now + timedelta(seconds=1200)).weights_swept


def test_a_tick_that_sweeps_costs_the_same_queries_for_2_or_20_nodes(run_tick, leader, settings):
    settings.LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS = 0
    make_model("llama", min_replicas=0)
    run_tick()  # the first records the usage verdict, and sweeps nothing
    counts = {}
    for size in (2, 20):
        Weights.objects.all().delete()
        PendingCommand.objects.all().delete()
        for i in range(size):
            node = make_node(f"gpu-{size}-{i:02d}", gpus=0)
            hold(node, "org/llama")
            hold(node, "org/stale")
        now = timezone.now()
        leader.next_weights_sweep = now
        with CaptureQueriesContext(connection) as queries:
            assert run_tick(now=now).weights_removals_sent == size
        counts[size] = len(queries)
    assert counts[2] == counts[20]


def test_a_lora_adapters_weights_are_in_use_too(settings):
    """An adapter from the hub is downloaded into the same cache as the models (engines' HF_HOME)."""
    settings.LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS = 0
    a = make_node("gpu-a", gpus=0)
    base = make_model("llama", min_replicas=0, max_adapters=2)
    Adapter.objects.create(name="support", base=base, source="org/support-lora")
    Adapter.objects.create(name="local", base=base, source="/data/loras/local")
    hold(a, "org/support-lora")
    hold(a, "loras/local", path="/data/loras/local")
    hold(a, "org/gone-lora")
    assert sweep(timezone.now()) == [("gpu-a", "org/gone-lora")]
