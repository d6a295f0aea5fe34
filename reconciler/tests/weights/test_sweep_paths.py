"""Weights in use is a rule about paths: a profile's folder inside a hub cache entry keeps the entry, a folder of
weights keeps what lies inside it, a sibling with a common prefix is not kept, and a running engine's weights stay
in use after its model's source is edited, until it stops."""

from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from catalog.models import Adapter, Model
from reconciler.choices import ReplicaState
from reconciler.models import Replica
from reconciler.tests.weights.test_sweep import hold, sweep
from reconciler.weights.removal import in_use, remove_unused_weights
from tests.fleet import make_model, make_node

pytestmark = pytest.mark.django_db

DAY = timedelta(days=1)
ENTRY = "/data/w/hub/models--org--x"


def test_a_profile_whose_source_lies_inside_a_hub_cache_entry_keeps_the_entry_past_the_grace_period(settings):
    # Read on an earlier commit: the row (the entry) was matched against the profile's key (a folder inside it)
    # by exact key only, so the sweep removed weights a profile used once the grace period passed.
    settings.LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS = DAY.total_seconds()
    node = make_node("gpu-a", gpus=0)
    model = make_model("x", min_replicas=0)
    Model.objects.filter(pk=model.pk).update(source=f"{ENTRY}/snapshots/abc123")
    hold(node, "org/x", path=ENTRY)
    hold(node, "org/x2", path=ENTRY + "2")  # a common prefix, not inside: unused
    now = timezone.now()
    assert sweep(now) == []
    assert sweep(now + 2 * DAY) == [("gpu-a", "org/x2")]


@pytest.mark.parametrize(
    ("path", "keys", "used"),
    [
        (ENTRY, {f"{ENTRY}/snapshots/abc"}, True),  # the source inside the row
        ("/models/gguf/a.gguf", {"/models/gguf"}, True),  # the row inside the source folder
        ("/models/gguf/a.gguf", {"/models/gguf/a.gguf"}, True),
        (ENTRY + "2", {f"{ENTRY}/snapshots/abc"}, False),  # a sibling sharing a prefix
        ("/models/gguf2/a.gguf", {"/models/gguf"}, False),
        (ENTRY, {"org/y"}, False),
    ],
)
def test_in_use_compares_paths_by_whole_components(path, keys, used):
    assert in_use("src", path, keys) is used


def test_an_adapter_folder_inside_an_entry_keeps_it_too(settings):
    settings.LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS = 0
    node = make_node("gpu-a", gpus=0)
    base = make_model("base", min_replicas=0)
    Adapter.objects.create(name="tuned", base=base, source=f"{ENTRY}/snapshots/abc")
    hold(node, "org/base")
    hold(node, "org/x", path=ENTRY)
    assert sweep(timezone.now() + DAY) == []


def test_a_running_engines_weights_stay_after_its_source_is_edited_and_go_once_it_stops(settings):
    settings.LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS = DAY.total_seconds()
    node = make_node("gpu-a", gpus=0)
    model = make_model("m", min_replicas=0)
    replica = Replica.objects.create(model=model, profile=model.profiles.get(), state=ReplicaState.READY,
                                     source="org/m")  # fmt: skip
    hold(node, "org/m")
    Model.objects.filter(pk=model.pk).update(source="org/m-v2")  # edited while its engine runs
    now = timezone.now()
    assert sweep(now) == [] and sweep(now + 2 * DAY) == []
    replica.delete()  # stopped
    assert sweep(now + 2 * DAY) == []  # found unused now: a grace period from here
    assert sweep(now + 4 * DAY) == [("gpu-a", "org/m")]


def test_deleting_a_model_removes_nothing_another_profiles_path_source_still_lies_in(
    django_capture_on_commit_callbacks,
):
    node = make_node("gpu-a", gpus=0)
    make_model("hub-x")  # source org/x: its weights are the entry
    local = make_model("local-x", min_replicas=0)
    Model.objects.filter(pk=local.pk).update(source=f"{ENTRY}/snapshots/abc")
    hold(node, "org/x", path=ENTRY)
    with django_capture_on_commit_callbacks(execute=True), transaction.atomic():
        Model.objects.get(name="hub-x").delete()
    assert remove_unused_weights({"org/x"}) == 0  # the other profile's folder lies inside the entry
