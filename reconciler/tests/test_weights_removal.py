"""Deleting a model or a profile sends remove_weights, after commit, to the nodes holding a source nobody uses now."""

import pytest
from django.db import transaction
from django.utils import timezone

from catalog.models import Model, Profile
from inventory.models import Weights
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
    with django_assert_max_num_queries(5), django_capture_on_commit_callbacks(execute=True):
        removal[0]()  # profiles still there; savepoint, the holders, the epoch, release
    assert sorted(c["source"] for c in inbox["gpu-a"]()) == [f"org/m{i}" for i in range(5)]
