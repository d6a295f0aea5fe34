"""A pending replica's hold is a field queried by value; its placement note is only text for operators."""

import pytest

from conftest import migrate_to
from reconciler.choices import Hold, ReplicaState
from reconciler.endpoints import build_endpoint_table
from reconciler.models import Replica
from reconciler.placement.eviction import MAKING_ROOM, WAITING_FOR_NODES
from tests.fleet import make_model, make_replica

pytestmark = pytest.mark.django_db


def pending(name, note, hold):
    replica = make_replica(make_model(name).profiles.get(), state=ReplicaState.PENDING, error=note)
    Replica.objects.filter(pk=replica.pk).update(hold=hold)
    return replica


def test_holding_and_not_holding_follow_the_field_not_the_text():
    held = pending("held", "stopping replica 7", Hold.MAKING_ROOM)
    waits = pending("waits", "no node has GPU class X", Hold.WAITING_FOR_NODES)
    # A note that merely reads like a hold (say an operator's words) holds nothing.
    stuck = pending("stuck", MAKING_ROOM + "in words only", Hold.NONE)
    assert set(Replica.objects.holding()) == {held, waits}
    assert list(Replica.objects.not_holding()) == [stuck]
    # Routers answer "unplaceable" at once only for the replica that holds nothing, whatever the notes say.
    models = build_endpoint_table().models
    assert (models["held"].unplaceable, models["waits"].unplaceable) == (None, None)
    assert models["stuck"].unplaceable == MAKING_ROOM + "in words only"


@pytest.mark.django_db(transaction=True)
def test_the_migration_reads_each_pending_replicas_hold_from_its_note_once():
    before, after = [("reconciler", "0005_pending_command")], [("reconciler", "0006_replica_hold")]
    old = migrate_to(before)
    model = old.get_model("catalog", "Model").objects.create(name="m")
    profile = old.get_model("catalog", "Profile").objects.create(model=model, gpu_class="H100-80GB")
    rows = {
        "room": ("pending", MAKING_ROOM + "stopping replica 7"),
        "nodes": ("pending", WAITING_FOR_NODES + "no node has GPU class X"),
        "stuck": ("pending", "no node has GPU class X"),
        "ready": ("ready", ""),
    }
    ids = {
        name: old.get_model("reconciler", "Replica")
        .objects.create(model=model, profile=profile, state=state, placement_error=note)
        .pk
        for name, (state, note) in rows.items()
    }

    new = migrate_to(after).get_model("reconciler", "Replica")
    holds = {name: new.objects.get(pk=pk).hold for name, pk in ids.items()}
    assert holds == {"room": "making_room", "nodes": "waiting_for_nodes", "stuck": "", "ready": ""}

    # Back to the latest state for the tests that follow.
    migrate_to()


# SQLite renames a column only with foreign key checks off, which it cannot do inside the test's transaction.
@pytest.mark.django_db(transaction=True)
def test_the_placement_note_keeps_what_the_column_held_before_its_rename():
    before, after = (
        [("reconciler", "0011_pending_command_weights_subject")],
        [("reconciler", "0012_replica_placement_note")],
    )
    old = migrate_to(before)
    model = old.get_model("catalog", "Model").objects.create(name="m")
    profile = old.get_model("catalog", "Profile").objects.create(model=model, gpu_class="H100-80GB")
    replica = old.get_model("reconciler", "Replica").objects.create(
        model=model, profile=profile, state="pending", placement_error="no node has GPU class X"
    )

    new = migrate_to(after).get_model("reconciler", "Replica")
    assert new.objects.get(pk=replica.pk).placement_note == "no node has GPU class X"

    migrate_to()
