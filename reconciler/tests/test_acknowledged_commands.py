"""Commands are pending until the agent acknowledges them, and the tick sends them again meanwhile."""

import logging
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from reconciler.commands import acknowledge, acknowledge_many, resend_unacknowledged
from reconciler.models import PendingCommand
from reconciler.outbox import Outbox
from tests.fleet import make_model, make_node

pytestmark = pytest.mark.django_db


def decide(commands, now=None, epoch=1):
    """Queue (node, shard id, kind) commands as a tick does and commit them; returns the pending rows."""
    outbox = Outbox(epoch, now)
    with transaction.atomic():
        for node_name, shard_id, kind in commands:
            if kind == "stop":
                outbox.stop(node_name, shard_id)
            else:
                outbox.drain(node_name, shard_id, 30)
        outbox.send_on_commit()
    return list(PendingCommand.objects.order_by("shard_id"))


def test_an_unacknowledged_start_is_sent_again_about_a_second_later_as_the_same_command(
    run_tick, agent_inbox, settings
):
    settings.LLMGW_COMMAND_RESEND_SECONDS = 1
    make_node("gpu-a")
    make_model("llama")
    inbox = agent_inbox("gpu-a")
    now = timezone.now()
    run_tick(now=now)
    (first,) = inbox()
    pending = PendingCommand.objects.get()
    assert (pending.kind, pending.shard_id, pending.attempts) == ("start_shard", first["shard_id"], 1)

    # ±20% jitter around one second: not before 0.8 s, always by 1.2 s.
    assert run_tick(now=now + timedelta(seconds=0.7)).commands_resent == 0
    assert run_tick(now=now + timedelta(seconds=1.25)).commands_resent == 1
    assert inbox() == [first]
    assert PendingCommand.objects.get().cid == pending.cid  # the same command, not a new decision
    assert PendingCommand.objects.get().attempts == 2

    assert acknowledge("gpu-a", pending.cid)
    # (Within LLMGW_START_RESEND_SECONDS: after it, a start acknowledged and never answered is sent again.)
    assert run_tick(now=now + timedelta(seconds=5)).commands_resent == 0
    assert inbox() == [] and not PendingCommand.objects.exists()


def test_resends_back_off_doubling_up_to_eight_times_the_first_delay(settings):
    settings.LLMGW_COMMAND_RESEND_SECONDS = 1
    now = timezone.now()
    decide([("gpu-a", 1, "stop")], now)
    gaps = []
    for _ in range(6):
        due = PendingCommand.objects.get().due_at
        gaps.append((due - now).total_seconds())
        now = due
        with transaction.atomic():
            assert resend_unacknowledged(now) == 1
    for gap, base in zip(gaps, [1, 2, 4, 8, 8, 8], strict=True):
        assert 0.8 * base <= gap <= 1.2 * base


def test_a_newer_command_for_the_same_shard_supersedes_the_pending_one(settings):
    now = timezone.now()
    (start,) = decide([("gpu-a", 7, "stop")], now)
    (drain,) = decide([("gpu-a", 7, "drain")], now)
    assert drain.cid != start.cid and drain.kind == "drain_shard"
    assert PendingCommand.objects.count() == 1
    # The older command's late ack changes nothing; only the newer one is ever sent again.
    assert not acknowledge("gpu-a", start.cid)
    with transaction.atomic():
        assert resend_unacknowledged(now + timedelta(seconds=2)) == 1
    assert PendingCommand.objects.get().payload["type"] == "drain_shard"


def test_an_ack_from_another_node_does_not_settle_a_command():
    (pending,) = decide([("gpu-a", 1, "stop")])
    assert not acknowledge("gpu-b", pending.cid)
    assert acknowledge_many([("gpu-b", pending.cid)]) == 0
    assert PendingCommand.objects.exists()


def test_a_refused_command_is_settled_and_the_refusal_logged(caplog):
    (pending,) = decide([("gpu-a", 1, "stop")])
    with caplog.at_level(logging.WARNING, logger="reconciler.commands"):
        assert acknowledge("gpu-a", pending.cid, refused=True, message="epoch 1 is older than epoch 2")
    assert "refused command" in caplog.text and "epoch 1 is older" in caplog.text
    assert not PendingCommand.objects.exists()


def test_one_tick_resends_at_most_the_batch_oldest_first(settings):
    settings.LLMGW_COMMAND_RESEND_BATCH = 3
    now = timezone.now()
    decide([(f"gpu-{i}", i, "stop") for i in range(5)], now)
    PendingCommand.objects.update(due_at=now)
    PendingCommand.objects.filter(shard_id=4).update(due_at=now - timedelta(seconds=5))
    with transaction.atomic():
        assert resend_unacknowledged(now) == 3
    resent = set(PendingCommand.objects.filter(attempts=2).values_list("shard_id", flat=True))
    assert len(resent) == 3 and 4 in resent


@pytest.mark.parametrize("pending", [2, 50])
def test_resending_costs_the_same_queries_for_2_or_50_commands(pending, django_assert_num_queries):
    now = timezone.now()
    decide([(f"gpu-{i}", i, "stop") for i in range(pending)], now)
    with transaction.atomic(), django_assert_num_queries(2):  # the due rows; their next due time
        assert resend_unacknowledged(now + timedelta(seconds=30)) == pending
    answered = list(PendingCommand.objects.values_list("node_name", "cid"))
    with django_assert_num_queries(2):  # the ids looked up; the rows of their own nodes deleted
        assert acknowledge_many(answered) == pending
