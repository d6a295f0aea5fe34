"""Weights on disk per node: recorded from hello and heartbeats (writing only what changed), and removal answers."""

import logging

import pytest
from django.utils import timezone

from inventory.models import Node, Weights, human_size
from inventory.services import record_heartbeat, record_weights, record_weights_status, register_nodes
from nodewire.protocol import Heartbeat, Hello, WeightsStatus
from nodewire.weights.messages import WeightsReport

pytestmark = pytest.mark.django_db


def report(source, size=100, path=None) -> WeightsReport:
    return WeightsReport(source=source, path=path or f"/w/hub/models--{source.replace('/', '--')}", size_bytes=size)


@pytest.fixture
def node():
    return Node.objects.create(name="gpu-a")


def test_hello_records_the_weights_and_a_hello_without_weights_leaves_them(node):
    register_nodes([(node.pk, Hello(node="gpu-a", version="v", address="a", gpus=[], weights=[report("org/m", 5)]))])
    assert list(Weights.objects.values_list("source", "size_bytes")) == [("org/m", 5)]
    register_nodes([(node.pk, Hello(node="gpu-a", version="v", address="a", gpus=[]))])  # an older agent: unknown
    assert Weights.objects.count() == 1


def test_only_what_changed_is_written(node, django_assert_num_queries):
    now = timezone.now()
    record_weights(node.pk, [report("org/a"), report("org/b"), report("org/c")], now)
    with django_assert_num_queries(1):  # the same list again: one read, no write
        assert record_weights(node.pk, [report("org/a"), report("org/b"), report("org/c")], now) == (0, 0, 0)
    with django_assert_num_queries(5):  # read, insert, update, delete (and the gone weights' ready stages)
        assert record_weights(node.pk, [report("org/a"), report("org/b", size=7), report("org/d")], now) == (1, 1, 1)
    assert list(Weights.objects.order_by("source").values_list("source", "size_bytes")) == [
        ("org/a", 100),
        ("org/b", 7),
        ("org/d", 100),
    ]


def test_a_heartbeat_without_weights_does_not_touch_them(node, django_assert_num_queries):
    record_weights(node.pk, [report("org/a")], timezone.now())
    with django_assert_num_queries(1) as queries:  # node alive (no GPUs to read; the heartbeat's transaction)
        record_heartbeat(node.pk, Heartbeat(gpus=[]))
    assert not [q for q in queries.captured_queries if "inventory_weights" in q["sql"]]
    record_heartbeat(node.pk, Heartbeat(gpus=[], weights=[]))
    assert not Weights.objects.exists()


def test_a_removal_forgets_the_row_and_a_refusal_keeps_it_with_a_warning(node, caplog):
    record_weights(node.pk, [report("org/a"), report("org/b")], timezone.now())
    refused = WeightsStatus(source="org/a", path="/w/hub/models--org--a", removed=False, message="refused: outside")
    with caplog.at_level(logging.WARNING, logger="inventory.services"):
        assert record_weights_status(node, refused) is False
    assert "node gpu-a kept the weights of org/a at /w/hub/models--org--a: refused: outside" in caplog.text
    assert Weights.objects.filter(source="org/a").exists()
    removed = WeightsStatus(source="org/a", path="/w/hub/models--org--a", removed=True, message="removed")
    assert record_weights_status(node, removed) is True
    assert list(Weights.objects.values_list("source", flat=True)) == ["org/b"]


@pytest.mark.parametrize(
    ("size", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (16 * 1024**3, "16.0 GiB"), (3 * 1024**4, "3.0 TiB")],
)
def test_sizes_read_in_powers_of_1024(size, text):
    assert human_size(size) == text
