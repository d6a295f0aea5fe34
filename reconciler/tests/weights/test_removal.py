"""Deleting a model or a profile sends remove_weights, after commit, to the nodes holding a source nobody uses now;
pending until the agent acknowledges it, as every command."""

from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from agentlink.services import on_hellos
from catalog.models import Model, Profile
from inventory.models import Weights
from nodewire.protocol import Hello
from reconciler.commands import acknowledge, resend_unacknowledged
from reconciler.models import PendingCommand
from reconciler.outbox import Outbox
from tests.fleet import H100, make_model, make_node

pytestmark = pytest.mark.django_db


def hold(node, source):
    path = f"/w/hub/models--{source.replace('/', '--')}"
    Weights.objects.create(node=node, source=source, path=path, size_bytes=1, seen_at=timezone.now())
    return path


@pytest.fixture
def fleet(agent_inbox):
    nodes = [make_node(name, gpus=1) for name in ("gpu-a", "gpu-b", "gpu-c")]
    return nodes, {n.name: agent_inbox(n.name) for n in nodes}


def test_deleting_a_model_asks_every_holder_to_remove_its_weights(fleet, leader, django_capture_on_commit_callbacks):
    (a, b, c), inbox = fleet
    path = hold(a, "org/llama")
    hold(b, "org/llama")
    hold(c, "org/other")
    make_model("other")
    with django_capture_on_commit_callbacks(execute=True):
        make_model("llama").delete()
    expected = {"type": "remove_weights", "v": 1, "epoch": leader.epoch, "source": "org/llama", "path": path}
    assert inbox["gpu-a"]() == [expected]
    assert inbox["gpu-b"]() == [expected]
    assert inbox["gpu-c"]() == []
    # The rows stay until the agents answer (weights_status).
    assert Weights.objects.filter(source="org/llama").count() == 2


def test_nothing_is_sent_while_another_profile_still_uses_the_source(fleet, django_capture_on_commit_callbacks):
    (a, _, _), inbox = fleet
    hold(a, "org/llama")
    model = make_model("llama")
    fallback = Profile.objects.create(model=model, gpu_class="L40S-48GB", order=1)
    with django_capture_on_commit_callbacks(execute=True):
        fallback.delete()
    assert inbox["gpu-a"]() == []
    # A second model on the same weights keeps them when the first goes.
    twin = Model.objects.create(name="llama-twin", source="org/llama")
    Profile.objects.create(model=twin, gpu_class=H100)
    with django_capture_on_commit_callbacks(execute=True):
        model.delete()
    assert inbox["gpu-a"]() == []
    with django_capture_on_commit_callbacks(execute=True):
        twin.profiles.get().delete()  # the last profile using the source
    assert [c["source"] for c in inbox["gpu-a"]()] == ["org/llama"]


def test_a_deletion_that_rolls_back_sends_nothing(fleet, django_capture_on_commit_callbacks):
    (a, _, _), inbox = fleet
    hold(a, "org/llama")
    model = make_model("llama")
    with (
        django_capture_on_commit_callbacks(execute=True) as callbacks,
        pytest.raises(RuntimeError),
        transaction.atomic(),
    ):
        model.delete()
        raise RuntimeError("the operator's transaction failed")
    assert callbacks == [] and inbox["gpu-a"]() == []
    assert Model.objects.filter(name="llama").exists()


def test_many_deletions_in_one_transaction_are_checked_once_after_commit(
    fleet, django_capture_on_commit_callbacks, django_assert_max_num_queries
):
    (a, _, _), inbox = fleet
    for i in range(5):
        hold(a, f"org/m{i}")
        make_model(f"m{i}")
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        Model.objects.filter(name__startswith="m").delete()
    removal = [cb for cb in callbacks if hasattr(cb, "keys")]
    assert len(removal) == 1 and removal[0].keys == {f"org/m{i}" for i in range(5)}
    with django_assert_max_num_queries(7), django_capture_on_commit_callbacks(execute=True):
        # profiles and adapters; the running engines' sources; savepoint, the holders, the epoch, the pending
        # rows, release
        removal[0]()
    assert sorted(c["source"] for c in inbox["gpu-a"]()) == [f"org/m{i}" for i in range(5)]


def test_a_removal_is_pending_until_the_agent_acknowledges_it_and_sent_again_meanwhile(
    fleet, leader, settings, django_capture_on_commit_callbacks
):
    settings.LLMGW_COMMAND_RESEND_SECONDS = 1
    (a, _, _), inbox = fleet
    hold(a, "org/llama")
    with django_capture_on_commit_callbacks(execute=True):
        make_model("llama").delete()
    (first,) = inbox["gpu-a"]()
    pending = PendingCommand.objects.get()
    assert (pending.node_name, pending.shard_id, pending.subject) == ("gpu-a", 0, "weights:org/llama")
    assert (pending.kind, pending.payload["epoch"]) == ("remove_weights", leader.epoch)

    # The message was lost: it goes again, the same command, until the agent acknowledges it.
    with django_capture_on_commit_callbacks(execute=True), transaction.atomic():
        assert resend_unacknowledged(timezone.now() + timedelta(seconds=2)) == 1
    assert inbox["gpu-a"]() == [first]
    assert acknowledge("gpu-a", pending.cid)
    with django_capture_on_commit_callbacks(execute=True), transaction.atomic():
        assert resend_unacknowledged(timezone.now() + timedelta(minutes=5)) == 0
    assert inbox["gpu-a"]() == []


def test_a_removal_never_replaces_a_shards_pending_command_nor_another_sources_removal():
    now = timezone.now()
    outbox = Outbox(epoch=3, now=now)
    with transaction.atomic():
        outbox.stop("gpu-a", 1)
        outbox.load_adapter("gpu-a", 1, "weights:org/a", "/adapters/a")  # an adapter named like a subject
        outbox.remove_weights("gpu-a", "org/a", "/w/hub/models--org--a")
        outbox.remove_weights("gpu-a", "org/b", "/w/hub/models--org--b")
        outbox.remove_weights("gpu-b", "org/a", "/w/hub/models--org--a")
        outbox.send_on_commit()
    rows = set(PendingCommand.objects.values_list("node_name", "shard_id", "subject", "kind"))
    assert rows == {
        ("gpu-a", 1, "", "stop_shard"),
        ("gpu-a", 1, "weights:org/a", "load_adapter"),
        ("gpu-a", 0, "weights:org/a", "remove_weights"),
        ("gpu-a", 0, "weights:org/b", "remove_weights"),
        ("gpu-b", 0, "weights:org/a", "remove_weights"),
    }
    # A newer removal of the same source on the same node replaces the pending one, and nothing else.
    first = PendingCommand.objects.get(node_name="gpu-a", subject="weights:org/a", kind="remove_weights").cid
    with transaction.atomic():
        again = Outbox(epoch=4, now=now)
        again.remove_weights("gpu-a", "org/a", "/w/hub/models--org--a")
        again.send_on_commit()
    assert PendingCommand.objects.count() == 5
    newer = PendingCommand.objects.get(node_name="gpu-a", subject="weights:org/a", kind="remove_weights")
    assert newer.cid != first and newer.payload["epoch"] == 4


def test_a_node_offline_at_the_deletion_gets_the_removal_when_it_says_hello(
    run_tick, agent_inbox, django_capture_on_commit_callbacks
):
    node = make_node("gpu-a", gpus=0)
    hold(node, "org/llama")
    with django_capture_on_commit_callbacks(execute=True):
        make_model("llama").delete()  # gpu-a has no stream now: nobody receives it
    # Long offline: its resends have backed off far beyond the next tick.
    PendingCommand.objects.update(due_at=timezone.now() + timedelta(minutes=10))
    assert run_tick().commands_resent == 0

    inbox = agent_inbox("gpu-a")
    with django_capture_on_commit_callbacks(execute=True):
        on_hellos([(node.pk, Hello(node="gpu-a", version="1.0", address="10.0.0.1", gpus=[]))])
    assert run_tick().commands_resent == 1
    assert [(c["type"], c["source"]) for c in inbox()] == [("remove_weights", "org/llama")]
