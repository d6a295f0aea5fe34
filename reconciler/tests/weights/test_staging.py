"""Staging in the tick: a replica whose hub weights its node lacks waits for them holding no GPU, then is
placed there; a failed stage fails it; a quiet stage is asked for again; routers hear what is left."""

from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from agentlink.services import on_staging_status
from catalog.engine_flags import pinned_revision
from inventory.choices import StagingState
from inventory.models import Node, Weights, WeightsStage
from inventory.services import record_weights
from nodewire.weights.staging_messages import StagingStatus
from reconciler.choices import Hold, ReplicaState
from reconciler.endpoints import build_endpoint_table
from reconciler.models import GPUAssignment, PendingCommand, Replica, Shard
from tests.fleet import make_model, make_node

pytestmark = pytest.mark.django_db

GB = 10**9


def staging_node(name="gpu-a", gpus=2):
    node = make_node(name, gpus=gpus)
    node.stages_weights = True
    node.save(update_fields=["stages_weights"])
    return node


def report(node, source, state, done=0, total=2 * GB, rate=0.0, message=""):
    on_staging_status(
        node.pk,
        StagingStatus(
            source=source, state=state, bytes_done=done, bytes_total=total, bytes_per_second=rate, message=message
        ),
    )


def test_a_replica_waits_for_its_weights_holding_no_gpu_while_another_model_is_placed_then_goes_on_their_node(
    run_tick, agent_inbox
):
    node = staging_node(gpus=2)
    inbox = agent_inbox("gpu-a")
    big = make_model("big", engine="vllm")
    run_tick()
    replica = Replica.objects.get(model=big)
    assert (replica.state, replica.hold) == (ReplicaState.PENDING, Hold.STAGING)
    assert "staging its weights on gpu-a" in replica.placement_note
    assert not Shard.objects.exists() and not GPUAssignment.objects.exists()
    (command,) = inbox()
    assert (command["type"], command["source"], command["revision"]) == ("stage_weights", "org/big", "main")
    assert WeightsStage.objects.get(node=node, source="org/big").state == StagingState.ASKED
    assert PendingCommand.objects.filter(subject="stage:org/big").count() == 1

    # Meanwhile another model (its weights on the node) takes the node's GPUs it needs.
    small = make_model("small", engine="vllm")
    Weights.objects.create(node=node, source="org/small", path="/w/hub/models--org--small", size_bytes=1,
                           seen_at=timezone.now())  # fmt: skip
    report(node, "org/big", "fetching", done=GB // 2, rate=100e6)
    run_tick()
    assert Replica.objects.get(model=small).state == ReplicaState.STARTING
    assert Replica.objects.get(model=big).state == ReplicaState.PENDING
    assert [c["type"] for c in inbox()] == ["start_shard"]  # no second stage_weights while one is under way

    report(node, "org/big", "ready", done=2 * GB, message="2000000000 bytes in 20.0 s")
    run_tick()
    replica.refresh_from_db()
    assert (replica.state, replica.hold) == (ReplicaState.STARTING, Hold.NONE)
    assert replica.shards.get().node == node
    start = [c for c in inbox() if c["type"] == "start_shard"]
    assert [c["source"] for c in start] == ["org/big"]


def test_a_failed_stage_fails_the_replica_with_its_words_and_no_engine_starts(run_tick, agent_inbox):
    node = staging_node()
    inbox = agent_inbox("gpu-a")
    model = make_model("broken", engine="vllm")
    run_tick()
    report(node, "org/broken", "failed", message="config.json: the bytes fetched do not hash to the published sha256")
    run_tick()
    replica = Replica.objects.get(model=model)
    assert replica.state == ReplicaState.FAILED and replica.hold == Hold.NONE
    assert "staging its weights on gpu-a failed: config.json: the bytes fetched" in replica.last_error
    assert replica.next_attempt_at is not None and replica.failure_count == 1
    assert not any(c["type"] == "start_shard" for c in inbox())
    assert not Shard.objects.exists()


def test_without_a_weights_root_or_for_engines_left_out_the_engine_downloads_itself_as_before(run_tick):
    make_node("plain", gpus=1)  # its agent has no weights root: it cannot stage
    vllm = make_model("on-plain", engine="vllm")
    run_tick()
    assert Replica.objects.get(model=vllm).state == ReplicaState.STARTING
    staging_node("rooted", gpus=1)
    mock = make_model("mocked", engine="mock")  # the mock engine loads nothing: not staged by default
    run_tick()
    assert Replica.objects.get(model=mock).state == ReplicaState.STARTING
    with override_settings(LLMGW_STAGE_ENGINES=[]):
        local = make_model("local", engine="vllm")
        staging_node("rooted-2", gpus=1)
        run_tick()
    assert Replica.objects.get(model=local).state == ReplicaState.STARTING
    assert not WeightsStage.objects.exists()


def test_a_stage_its_agent_went_quiet_on_is_asked_for_again(run_tick, agent_inbox, leader):
    node = staging_node()
    inbox = agent_inbox("gpu-a")
    make_model("slow", engine="vllm")
    now = timezone.now()
    run_tick(now=now)
    assert [c["type"] for c in inbox()] == ["stage_weights"]
    PendingCommand.objects.all().delete()  # acknowledged
    report(node, "org/slow", "fetching", done=GB)
    quiet = now + timedelta(seconds=61)
    WeightsStage.objects.update(updated_at=now)
    leader.next_stall_check = None
    Node.objects.update(last_seen=quiet + timedelta(seconds=16))  # its heartbeats go on
    run_tick(now=quiet)  # the first tick only sets when stalls are looked for
    assert inbox() == []
    run_tick(now=quiet + timedelta(seconds=16))
    assert [(c["type"], c["source"]) for c in inbox()] == [("stage_weights", "org/slow")]
    assert WeightsStage.objects.get().updated_at == quiet + timedelta(seconds=16)


def test_routers_hold_its_requests_as_staging_with_what_is_left_in_the_eta(run_tick):
    node = staging_node()
    model = make_model("eta", engine="vllm", start_seconds=30.0)
    run_tick()
    report(node, "org/eta", "fetching", done=GB, total=2 * GB, rate=10e6)  # 100 s left
    entry = build_endpoint_table().models["eta"]
    assert entry.holding == "staging"
    assert entry.start_seconds == 30.0 + 105.0  # 100 s left, in 15 s steps
    report(node, "org/eta", "ready", done=2 * GB)
    run_tick()
    entry = build_endpoint_table().models["eta"]
    assert entry.holding is None and entry.start_seconds == 30.0
    assert Replica.objects.get(model=model).state == ReplicaState.STARTING


def test_weights_leaving_the_node_forget_its_ready_stage(run_tick):
    node = staging_node()
    make_model("gone", engine="vllm")
    run_tick()
    report(node, "org/gone", "ready", done=2 * GB)
    row = Weights.objects.create(node=node, source="org/gone", path="/w/hub/models--org--gone", size_bytes=2 * GB,
                                 seen_at=timezone.now())  # fmt: skip
    assert WeightsStage.objects.filter(state=StagingState.READY).count() == 1
    record_weights(node.pk, [], timezone.now())  # the next report no longer holds them
    assert not Weights.objects.filter(pk=row.pk).exists()
    assert not WeightsStage.objects.exists()


def serving_node(name, port=8479, gpus=1):
    node = staging_node(name, gpus=gpus)
    node.weights_port, node.address = port, f"10.0.0.{name[-1]}"
    node.save(update_fields=["weights_port", "address"])
    return node


def test_the_hub_is_asked_once_the_second_node_follows_the_first_and_a_copy_is_allowed_with_its_ticket(
    run_tick, agent_inbox
):
    serving_node("gpu-1"), serving_node("gpu-2")
    inboxes = {n: agent_inbox(n) for n in ("gpu-1", "gpu-2")}
    make_model("pair", engine="vllm", min_replicas=2, max_replicas=2)
    run_tick()
    sent = {n: inbox() for n, inbox in inboxes.items()}
    stages = {n: next(c for c in cs if c["type"] == "stage_weights") for n, cs in sent.items()}
    first, second = sorted(stages, key=lambda n: len(stages[n]["peers"]))
    assert stages[first]["peers"] == []  # from the hub
    (follow,) = stages[second]["peers"]
    assert (follow["node"], follow["url"]) == (first, f"http://10.0.0.{first[-1]}:8479")
    (allow,) = [c for c in sent[first] if c["type"] == "serve_weights"]
    assert (allow["source"], allow["node"], allow["ticket"]) == ("org/pair", second, follow["ticket"])
    assert WeightsStage.objects.get(node__name=second).peers == [first]


def test_a_holder_is_copied_from_but_never_by_more_than_the_copies_it_may_serve(run_tick, agent_inbox):
    holder = serving_node("gpu-1")
    Weights.objects.create(node=holder, source="org/wide", path="/w/hub/models--org--wide", size_bytes=1,
                           seen_at=timezone.now())  # fmt: skip
    WeightsStage.objects.bulk_create(
        [
            WeightsStage(node=serving_node(f"gpu-{i}", gpus=0), source="org/other", state="fetching",
                         peers=["gpu-1"], asked_at=timezone.now(), updated_at=timezone.now())
            for i in (2, 3)
        ]
    )  # fmt: skip
    holder.gpus.all().delete()  # full of another model: the new replica goes elsewhere
    serving_node("gpu-4")
    inbox = agent_inbox("gpu-4")
    model = make_model("wide", engine="vllm")
    with override_settings(LLMGW_STAGE_PEER_COPIES=2):
        run_tick()
    assert not any(c["type"] == "stage_weights" for c in inbox())  # gpu-1 already feeds two copies: wait
    replica = Replica.objects.get(model=model)
    assert replica.hold == Hold.STAGING and "waits for a node holding them to be free" in replica.placement_note
    WeightsStage.objects.filter(source="org/other").update(state="ready")
    run_tick()
    (stage,) = [c for c in inbox() if c["type"] == "stage_weights"]
    assert [p["node"] for p in stage["peers"]] == ["gpu-1"]


def test_a_path_source_is_checked_on_its_node_not_copied_and_a_missing_path_fails_there(run_tick, agent_inbox):
    node = staging_node()
    holder = serving_node("gpu-9")  # holds the path too: it is still not a peer, nothing is copied
    inbox = agent_inbox("gpu-a")
    model = make_model("local", engine="vllm")
    model.source = "/models/local"
    model.save(update_fields=["source"])
    Weights.objects.create(node=holder, source="/models/local", path="/models/local", size_bytes=1,
                           seen_at=timezone.now())  # fmt: skip
    holder.gpus.all().delete()
    run_tick()
    (stage,) = [c for c in inbox() if c["type"] == "stage_weights"]
    assert (stage["source"], stage["peers"]) == ("/models/local", [])
    report(node, "/models/local", "failed", message="/models/local does not exist on this node")
    run_tick()
    replica = Replica.objects.get(model=model)
    assert replica.state == ReplicaState.FAILED and "does not exist on this node" in replica.last_error


def test_the_revision_the_engine_args_pin_is_the_one_staged(run_tick, agent_inbox):
    staging_node()
    inbox = agent_inbox("gpu-a")
    make_model("pinned", engine="vllm", engine_args=["--revision=0123abcd", "--max-model-len", "4096"])
    run_tick()
    (stage,) = [c for c in inbox() if c["type"] == "stage_weights"]
    assert stage["revision"] == "0123abcd"
    assert WeightsStage.objects.get().revision == "0123abcd"


@pytest.mark.parametrize(
    ("engine", "args", "revision"),
    [
        ("vllm", ["--revision", "v2"], "v2"),
        ("vllm", ["--revision=v1", "--revision=v3"], "v3"),  # the last one wins, as the engine's parser takes it
        ("sglang", ["--revision", "abc"], "abc"),
        ("vllm", ["--tokenizer-revision", "t"], None),
        ("llamacpp", ["--revision", "x"], None),
    ],
)
def test_a_pinned_revision_is_read_from_the_engine_args_as_the_engine_reads_it(engine, args, revision):
    assert pinned_revision(engine, args) == revision
