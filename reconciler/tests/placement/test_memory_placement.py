"""Placement refuses what cannot fit: a profile is placed only on nodes whose GPUs hold its estimated need."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from catalog.models import Model, Profile
from inventory.models import Node
from reconciler.choices import ReplicaState
from reconciler.models import PendingCommand, Replica, Shard, UsageWatch
from tests.fleet import make_model, make_node

pytestmark = pytest.mark.django_db

L40S = "L40S-48GB"
H100 = "H100-80GB"
# Llama 3.1 70B's shape in the catalog's words: bf16 weights, 80 layers of 8 KV heads of 128.
LLAMA_70B = {"parameters_billions": 70.0, "dtype": "bfloat16", "layers": 80, "kv_heads": 8, "head_dim": 128}


def sized(model: Model, **size) -> Model:
    Model.objects.filter(pk=model.pk).update(**(size or LLAMA_70B))
    return model


def test_a_profile_no_node_can_hold_is_unplaceable_with_the_numbers(run_tick):
    make_node("l40s-a", gpus=4, gpu_class=L40S)
    model = sized(make_model("llama-70b", gpu_class=L40S, gpus_per_node=2, max_model_len=8192))

    run_tick()

    replica = Replica.objects.get(model=model)
    assert replica.state == ReplicaState.PENDING
    # 140 GB of weights over 2 GPUs (65.2 GiB) + vLLM's 2.5 GiB + 1.2 GiB of KV for one 8192-token sequence.
    assert replica.placement_note.startswith("needs 68.9 GiB per GPU; L40S-48GB has 44.2 GiB usable (weights 65.2")
    assert not Shard.objects.exists()


def test_the_next_profile_is_tried_when_the_first_cannot_hold_the_model(run_tick):
    make_node("l40s-a", gpus=4, gpu_class=L40S)
    make_node("h100-a", gpus=2, gpu_class=H100)
    model = sized(make_model("llama-70b", gpu_class=L40S, gpus_per_node=2, max_model_len=8192))
    Profile.objects.create(model=model, order=1, gpu_class=H100, gpus_per_node=2, max_model_len=8192)

    run_tick()

    replica = Replica.objects.get(model=model)
    assert replica.state == ReplicaState.STARTING
    assert replica.profile.gpu_class == H100
    assert Shard.objects.get(replica=replica).node.name == "h100-a"


def test_only_nodes_whose_gpus_hold_it_are_candidates_within_a_class(run_tick):
    # One class, two memory sizes (an operator's class name shared by 40 and 80 GB cards): the small one is skipped
    # even though it fits best by GPU count.
    make_node("small", gpus=2, gpu_class="A100", memory_mb=40 * 1024)
    make_node("large", gpus=4, gpu_class="A100", memory_mb=80 * 1024)
    model = sized(make_model("llama-70b", gpu_class="A100", gpus_per_node=2, max_model_len=8192))

    run_tick()

    assert Shard.objects.get(replica__model=model).node.name == "large"


def test_unknown_size_or_unreported_memory_places_as_before(run_tick):
    make_node("a10", gpus=1, gpu_class="A10-24GB")
    make_node("unreported", gpus=2, gpu_class=L40S, memory_mb=0)
    unknown = make_model("no-size", gpu_class="A10-24GB")
    huge = sized(make_model("llama-70b", gpu_class=L40S, gpus_per_node=2))

    run_tick()

    assert Replica.objects.get(model=unknown).state == ReplicaState.STARTING
    assert Replica.objects.get(model=huge).state == ReplicaState.STARTING


def test_no_room_is_made_for_a_profile_no_node_can_hold(run_tick):
    make_node("l40s-a", gpus=2, gpu_class=L40S)
    busy = make_model("small", gpu_class=L40S, gpus_per_node=2)
    run_tick()
    assert Replica.objects.get(model=busy).state == ReplicaState.STARTING
    Replica.objects.filter(model=busy).update(state=ReplicaState.READY, last_used=None)
    huge = sized(make_model("llama-70b", gpu_class=L40S, gpus_per_node=2, max_model_len=8192))
    Profile.objects.filter(model=huge).update(priority=100)

    run_tick()

    assert Replica.objects.get(model=busy).state == ReplicaState.READY  # not evicted for nothing
    assert Replica.objects.get(model=huge).placement_note.startswith("needs 68.9 GiB per GPU")


def _tick_queries(run_tick, now):
    with CaptureQueriesContext(connection) as queries:
        run_tick(now=now)
    return len(queries)


def test_the_memory_check_adds_no_query_whatever_the_fleet_size(run_tick):
    counts = {}
    for size in (2, 12):
        Replica.objects.all().delete()
        Model.objects.all().delete()
        Node.objects.all().delete()
        UsageWatch.objects.all().delete()  # both sizes start with no verdict recorded
        PendingCommand.objects.all().delete()  # nor with the other size's commands due to be sent again
        for i in range(size):
            make_node(f"l40s-{i:02d}", gpus=2, gpu_class=L40S)
            sized(make_model(f"small-{i:02d}", gpu_class=L40S, gpus_per_node=2), parameters_billions=7, dtype="bf16")
            sized(make_model(f"huge-{i:02d}", gpu_class=L40S, gpus_per_node=2, max_model_len=8192))
        now = timezone.now()
        counts[size] = _tick_queries(run_tick, now)
        assert Replica.objects.filter(state=ReplicaState.STARTING).count() == size
        errors = Replica.objects.values_list("placement_note", flat=True)
        assert sum(error.startswith("needs 68.9 GiB") for error in errors) == size
    assert counts[2] == counts[12]


def test_the_start_command_carries_the_profiles_max_model_len_as_the_engines_flag(run_tick, agent_inbox):
    make_node("h100-a", gpus=2, gpu_class=H100)
    inbox = agent_inbox("h100-a")
    sized(make_model("llama-70b", gpu_class=H100, gpus_per_node=2, max_model_len=8192, engine_args=["--x", "1"]))

    run_tick()

    (start,) = [c for c in inbox() if c["type"] == "start_shard"]
    assert start["args"] == ["--x", "1", "--max-model-len", "8192"]
