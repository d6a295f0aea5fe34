"""Hellos are recorded together: a connect storm costs some tens of transactions of a few statements each."""

import asyncio

import pytest

from agent.gpus.discovery import parse_fake_gpus
from agentlink.batches import GroupCommit
from agentlink.services import on_hellos
from inventory.models import GPU, Node
from nodewire.parts import RunningShard
from nodewire.protocol import Hello
from reconciler.choices import ReplicaState
from reconciler.models import PendingCommand, Replica, Shard
from tests.fleet import make_model, make_node, make_replica


def hello(name: str, address: str = "10.0.0.1") -> Hello:
    gpus = [gpu.report() for gpu in parse_fake_gpus("8xH100-80GB", name)]
    return Hello(node=name, version="1.0", address=address, gpus=gpus)


@pytest.mark.django_db
@pytest.mark.parametrize("count", [3, 12])
def test_a_batch_of_hellos_costs_the_same_statements_however_many(count, django_assert_num_queries):
    """Nodes locked, marked seen, and their new address and version written; GPUs read and inserted; shards;
    held GPUs; pending commands. And the test's savepoint.

    (Up to the database's limit of parameters per statement: SQLite's 999 splits inserts of over 124 GPUs.)
    """
    nodes = [make_node(f"gpu-{i:02d}", gpus=0) for i in range(count)]
    with django_assert_num_queries(9 + 2):
        recorded = on_hellos([(node.pk, hello(node.name)) for node in nodes])
    assert [node.name for node in recorded] == [node.name for node in nodes]
    assert GPU.objects.count() == 8 * count
    assert set(Node.objects.values_list("agent_version", flat=True)) == {"1.0"}


@pytest.mark.django_db
def test_hellos_write_each_node_its_own_address_and_again_only_that_it_is_alive(django_assert_num_queries):
    nodes = [make_node(f"gpu-{i:02d}", gpus=0) for i in range(12)]
    hellos = [(node.pk, hello(node.name, f"10.0.0.{i}")) for i, node in enumerate(nodes)]
    on_hellos(hellos)
    assert dict(Node.objects.values_list("name", "reported_address")) == {
        f"gpu-{i:02d}": f"10.0.0.{i}" for i in range(12)
    }
    # Nothing reported changed: nodes locked and marked seen, GPUs read, shards, held GPUs, pending commands.
    with django_assert_num_queries(6 + 2):
        on_hellos(hellos)


@pytest.mark.django_db
def test_a_replica_spanning_two_nodes_of_one_batch_fails_once_and_its_other_engine_is_stopped():
    """gpu-a restarted and lost its engine: the two-node replica fails, and gpu-b's engine of it is an orphan."""
    a, b = make_node("gpu-a", gpus=0), make_node("gpu-b", gpus=0)
    profile = make_model("big", nodes_per_replica=2).profiles.get()
    replica = make_replica(profile, placement=[(a, []), (b, [])])
    worker = Shard.objects.get(node=b)
    running = RunningShard(shard_id=worker.pk, replica_id=replica.pk, state="ready", port=worker.port)

    on_hellos([(a.pk, hello("gpu-a")), (b.pk, Hello(**{**_fields(hello("gpu-b")), "shards": [running]}))])

    assert Replica.objects.get().state == ReplicaState.PENDING  # lost with its node: placed again at once
    assert not Shard.objects.exists()
    # The stop of gpu-b's engine is decided (recorded pending, sent after commit), not an error of the batch.
    assert list(PendingCommand.objects.values_list("node_name", "kind", "shard_id")) == [
        ("gpu-b", "stop_shard", worker.pk)
    ]


def _fields(message: Hello) -> dict:
    return {name: getattr(message, name) for name in message.__struct_fields__}


@pytest.mark.django_db
def test_a_node_that_said_hello_twice_in_one_batch_ends_as_its_last_hello_says():
    node, other = make_node("gpu-a", gpus=0), make_node("gpu-b", gpus=0)
    recorded = on_hellos(
        [(node.pk, hello("gpu-a", "10.0.0.1")), (other.pk, hello("gpu-b")), (node.pk, hello("gpu-a", "10.0.0.2"))]
    )
    assert [n.name for n in recorded] == ["gpu-a", "gpu-b", "gpu-a"]
    assert Node.objects.get(name="gpu-a").reported_address == "10.0.0.2"
    assert GPU.objects.filter(node=node).count() == 8


@pytest.mark.django_db
def test_a_hello_of_a_node_deleted_meanwhile_fails_the_batch_all_or_nothing():
    node, gone = make_node("gpu-a", gpus=0), make_node("gpu-b", gpus=0)
    gone_id = gone.pk
    gone.delete()
    with pytest.raises(Node.DoesNotExist, match="gpu-b"):
        on_hellos([(node.pk, hello("gpu-a")), (gone_id, hello("gpu-b"))])
    assert not GPU.objects.exists()


class Writes:
    """A write_many that fails any batch holding "bad", as a batch with one bad hello fails its transaction."""

    def __init__(self):
        self.calls: list[list[str]] = []

    def __call__(self, items: list[str]) -> list[str]:
        self.calls.append(list(items))
        if "bad" in items:
            raise ValueError("bad is not a node")
        return [item.upper() for item in items]


@pytest.mark.django_db(transaction=True)
def test_senders_share_one_write_and_a_bad_item_fails_only_its_own_sender():
    writes = Writes()
    commit = GroupCommit("things", writes, gather_seconds=0.05)

    async def scenario():
        return await asyncio.gather(*(commit.submit(item) for item in ["a", "bad", "b"]), return_exceptions=True)

    a, bad, b = asyncio.run(scenario())
    assert (a, b) == ("A", "B")
    assert isinstance(bad, ValueError) and str(bad) == "bad is not a node"
    # One write for the three, then one by one after it failed.
    assert writes.calls == [["a", "bad", "b"], ["a"], ["bad"], ["b"]]


@pytest.mark.django_db(transaction=True)
def test_items_arriving_during_a_write_go_together_in_the_next_and_at_most_max_items_at_a_time():
    writes = Writes()
    commit = GroupCommit("things", writes, gather_seconds=0.01, max_items=2)

    async def scenario():
        first = [asyncio.ensure_future(commit.submit(item)) for item in "abc"]
        await asyncio.sleep(0)
        later = [asyncio.ensure_future(commit.submit(item)) for item in "de"]
        return await asyncio.gather(*first, *later)

    assert asyncio.run(scenario()) == ["A", "B", "C", "D", "E"]
    assert writes.calls == [["a", "b"], ["c", "d"], ["e"]]
