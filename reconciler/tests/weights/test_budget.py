"""What a stage says its node may evict for a weights budget: no weights an engine there runs, none a profile
pins, least recently used first (never started on them first); placement stamps when weights were used."""

from datetime import timedelta

import pytest
from django.utils import timezone

from inventory.models import Weights
from reconciler.choices import ReplicaState
from reconciler.models import Replica
from reconciler.weights.budget import evictable_on
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


def test_evictable_weights_leave_out_the_running_and_the_pinned_least_recently_used_first(
    django_assert_num_queries,
):
    node, other = make_node("gpu-a"), make_node("gpu-b")
    now = timezone.now()
    running = make_model("running", engine="vllm")
    make_replica(running.profiles.get(), placement=[(node, [0])])
    make_model("pinned", engine="vllm", prefetch_nodes=2)
    for source, used in (("org/recent", now), ("org/never", None), ("org/running", now - timedelta(days=3)),
                         ("org/pinned", None), ("org/stale", now - timedelta(days=2))):  # fmt: skip
        Weights.objects.create(node=node, source=source, path=f"/w/hub/models--{source.replace('/', '--')}",
                               size_bytes=1, seen_at=now, last_used=used)  # fmt: skip
    Weights.objects.create(node=other, source="org/running", path="/w/x", size_bytes=1, seen_at=now)
    with django_assert_num_queries(3):
        found = evictable_on(["gpu-a", "gpu-b"])
    assert [e.source for e in found["gpu-a"]] == ["org/never", "org/stale", "org/recent"]
    assert [e.source for e in found["gpu-b"]] == ["org/running"]  # nothing runs it on gpu-b


def test_placing_a_replica_stamps_when_its_weights_were_last_used_on_its_node(run_tick):
    node = make_node("gpu-a")
    model = make_model("used", engine="vllm")
    row = Weights.objects.create(node=node, source="org/used", path="/w/hub/models--org--used", size_bytes=1,
                                 seen_at=timezone.now())  # fmt: skip
    run_tick()
    assert Replica.objects.get(model=model).state == ReplicaState.STARTING
    row.refresh_from_db()
    assert row.last_used is not None
