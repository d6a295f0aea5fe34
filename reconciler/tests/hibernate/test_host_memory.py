"""Host memory for level-1 sleepers: the budget per node decides level 1, level 2, or making room."""

from datetime import timedelta

import pytest
from django.utils import timezone

from agent.gpus.discovery import host_memory_mib
from catalog.choices import SleepLevel
from inventory.models import Node
from reconciler.choices import ReplicaState
from reconciler.hibernate.tier import SleepRequest, put_to_sleep
from reconciler.models import Replica
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db

GIB = 1 << 30


def node_with_host(name, host_gib):
    node = make_node(name, gpus=8)
    Node.objects.filter(pk=node.pk).update(reported_host_memory_mib=None if host_gib is None else host_gib * 1024)
    return node


def ready(name, node, index, *, weights_gib, engine="vllm", idle=600):
    model = make_model(name, engine=engine, min_replicas=0)
    replica = make_replica(
        model.profiles.get(), placement=[(node, [index])], last_used=timezone.now() - timedelta(seconds=idle)
    )
    Replica.objects.filter(pk=replica.pk).update(sleep_level=SleepLevel.OFFLOAD, weights_bytes=weights_gib * GIB)
    return replica


def sleep(*replicas):
    return put_to_sleep([SleepRequest(r.pk, SleepLevel.OFFLOAD, "test") for r in replicas], timezone.now())


def levels(*replicas):
    rows = dict(Replica.objects.values_list("pk", "sleeping_level"))
    return [rows.get(r.pk) for r in replicas]


def test_level_1_while_the_nodes_budget_holds_the_weights_then_level_2(settings):
    settings.LLMGW_HOST_MEMORY_SLEEP_FRACTION = 0.5
    node = node_with_host("gpu-a", 64)  # 32 GiB for level-1 sleepers
    first, second, third = (ready(n, node, i, weights_gib=15) for i, n in enumerate(("a", "b", "c")))
    assert sleep(first, second, third) == 3
    assert levels(first, second, third) == [SleepLevel.OFFLOAD, SleepLevel.OFFLOAD, SleepLevel.DISCARD]
    # Later sleeps count the ones already holding host memory.
    fourth = ready("d", node, 3, weights_gib=1)
    sleep(fourth)
    assert levels(fourth) == [SleepLevel.OFFLOAD]
    fifth = ready("e", node, 4, weights_gib=2)
    sleep(fifth)
    assert levels(fifth) == [SleepLevel.DISCARD]


def test_a_node_whose_host_memory_is_unknown_takes_no_level_1_sleeper():
    replica = ready("a", node_with_host("gpu-a", None), 0, weights_gib=1)
    sleep(replica)
    assert levels(replica) == [SleepLevel.DISCARD]


def test_an_engine_with_level_1_only_makes_room_by_stopping_the_least_recently_used_sleeper(settings):
    settings.LLMGW_HOST_MEMORY_SLEEP_FRACTION = 1.0
    node = node_with_host("gpu-a", 40)
    older = ready("older", node, 0, weights_gib=15, engine="sglang", idle=900)
    newer = ready("newer", node, 1, weights_gib=15, engine="sglang", idle=300)
    sleep(older)
    sleep(newer)
    comer = ready("comer", node, 2, weights_gib=20, engine="sglang")
    sleep(comer)
    states = dict(Replica.objects.values_list("pk", "state"))
    assert (states[older.pk], states[newer.pk], states[comer.pk]) == (
        ReplicaState.STOPPING,
        ReplicaState.SLEEPING,
        ReplicaState.SLEEPING,
    )
    assert Replica.objects.get(pk=older.pk).stop_reason == "stopped to free host memory for a newer sleeper"


def test_an_engine_with_level_1_only_that_cannot_fit_at_all_is_stopped_instead(settings):
    settings.LLMGW_HOST_MEMORY_SLEEP_FRACTION = 0.5
    replica = ready("huge", node_with_host("gpu-a", 40), 0, weights_gib=30, engine="sglang")
    assert sleep(replica) == 0
    stopped = Replica.objects.get(pk=replica.pk)
    assert stopped.state == ReplicaState.STOPPING and stopped.stop_reason.endswith("no host memory to sleep in")


def test_the_agent_reads_its_host_memory_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:        1000 kB\n")
    assert host_memory_mib(str(meminfo)) == 24000
    meminfo.write_text("MemFree:        1000 kB\n")
    assert host_memory_mib(str(meminfo)) is None
    assert host_memory_mib(str(tmp_path / "missing")) is None


def test_a_hello_records_the_nodes_host_memory_and_an_older_agents_leaves_it_unknown():
    from inventory.services import register_nodes
    from nodewire.protocol import Hello

    node = make_node("gpu-a")
    register_nodes([(node.pk, Hello(node="gpu-a", version="v", address="a", gpus=[], host_memory_mib=24000))])
    assert Node.objects.get(pk=node.pk).reported_host_memory_mib == 24000
    register_nodes([(node.pk, Hello(node="gpu-a", version="v", address="a", gpus=[]))])
    assert Node.objects.get(pk=node.pk).reported_host_memory_mib is None
