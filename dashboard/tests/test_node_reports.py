"""An agent's hello never overrides what an operator set; its report fills only the fields left empty,
and a disagreement shows as a warning in admin, the summary and ctl_status."""

from io import StringIO

import pytest
from django.core.management import call_command
from django.utils import timezone

from dashboard.summary import cluster_summary
from inventory.models import Node
from inventory.services import enrol_node, register_nodes
from nodewire.parts import GPUReport
from nodewire.protocol import Hello
from reconciler.choices import ReplicaState, ShardState
from reconciler.lifecycle.transitions import mark_ready_if_whole
from reconciler.models import Shard
from reconciler.placement.capacity import free_capacity
from tests.fleet import H100, make_model, make_replica

pytestmark = pytest.mark.django_db


def hello(name: str, address: str, fabric: str, labels: dict | None = None) -> Hello:
    gpus = [GPUReport(index=i, uuid=f"GPU-{name}-{i}", gpu_class=H100, memory_mb=81920, healthy=True) for i in range(2)]
    return Hello(node=name, version="0.1.0", address=address, fabric=fabric, labels=labels or {}, gpus=gpus)


def test_operator_address_and_fabric_survive_a_hello_that_reports_others_with_a_warning():
    node, _ = enrol_node("gpu-a", address="10.0.0.5", fabric="ib-a")
    Node.objects.filter(pk=node.pk).update(labels={"rack": "r1"})
    register_nodes([(node.pk, hello("gpu-a", "192.168.1.9", "ib-b", {"rack": "r9"}))])

    node.refresh_from_db()
    assert (node.address, node.fabric, node.labels) == ("10.0.0.5", "ib-a", {"rack": "r1"})
    assert (node.reported_address, node.reported_fabric, node.reported_labels) == (
        "192.168.1.9",
        "ib-b",
        {"rack": "r9"},
    )
    assert (node.effective_address, node.effective_fabric) == ("10.0.0.5", "ib-a")
    warnings = node.report_warnings()
    assert warnings == [
        "address set to “10.0.0.5” but its agent reports “192.168.1.9”",
        "fabric set to “ib-a” but its agent reports “ib-b”",
        "labels set to rack=r1 but its agent reports rack=r9",
    ]

    # Placement sees the operator's values.
    capacity = free_capacity(timezone.now()).nodes[H100]["gpu-a"]
    assert (capacity.address, capacity.fabric) == ("10.0.0.5", "ib-a")

    # Status: the summary's node entry and ctl_status carry the warnings.
    entry = next(n for n in cluster_summary().as_json()["node_list"] if n["name"] == "gpu-a")
    assert entry["warnings"] == warnings and entry["fabric"] == "ib-a"
    out = StringIO()
    call_command("ctl_status", stdout=out)
    assert "node gpu-a: address set to “10.0.0.5” but its agent reports “192.168.1.9”" in out.getvalue()
    out = StringIO()
    call_command("ctl_status", "--nodes", stdout=out)
    assert "fabric set to “ib-a” but its agent reports “ib-b”" in out.getvalue()


def test_empty_operator_fields_are_filled_from_the_report_and_placement_uses_them():
    node, _ = enrol_node("gpu-b")
    register_nodes([(node.pk, hello("gpu-b", "10.0.0.7", "ib-c", {"zone": "z1"}))])

    node.refresh_from_db()
    assert (node.address, node.fabric, node.labels) == ("", "", {})
    assert (node.effective_address, node.effective_fabric, node.labels or node.reported_labels) == (
        "10.0.0.7",
        "ib-c",
        {"zone": "z1"},
    )
    assert node.report_warnings() == []
    capacity = free_capacity(timezone.now()).nodes[H100]["gpu-b"]
    assert (capacity.address, capacity.fabric) == ("10.0.0.7", "ib-c")
    entry = next(n for n in cluster_summary().as_json()["node_list"] if n["name"] == "gpu-b")
    assert entry["fabric"] == "ib-c" and entry["warnings"] == []

    # The endpoint is published on the effective address.
    profile = make_model("m", min_replicas=0).profiles.get()
    replica = make_replica(profile, state=ReplicaState.STARTING, placement=[(node, [0])])
    Shard.objects.filter(replica=replica).update(state=ShardState.READY)
    assert mark_ready_if_whole(replica, timezone.now())
    port = Shard.objects.get(replica=replica).port
    assert replica.endpoint_url == f"http://10.0.0.7:{port}"

    # An operator sets the address later: the next hello does not take it back.
    Node.objects.filter(pk=node.pk).update(address="10.9.9.9")
    register_nodes([(node.pk, hello("gpu-b", "10.0.0.7", "ib-c"))])
    node.refresh_from_db()
    assert node.effective_address == "10.9.9.9"
    assert free_capacity(timezone.now()).nodes[H100]["gpu-b"].address == "10.9.9.9"


def test_admin_node_list_and_change_page_show_the_warning(admin_client):
    node, _ = enrol_node("gpu-c", address="10.0.0.5")
    register_nodes([(node.pk, hello("gpu-c", "10.0.0.6", ""))])
    expected = "address set to “10.0.0.5” but its agent reports “10.0.0.6”"
    listing = admin_client.get("/admin/inventory/node/").content.decode()
    assert expected in listing
    page = admin_client.get(f"/admin/inventory/node/{node.pk}/change/").content.decode()
    assert expected in page and "10.0.0.6" in page


def test_rest_node_shows_reports_and_warnings(admin_client):
    node, _ = enrol_node("gpu-d", fabric="ib-a")
    register_nodes([(node.pk, hello("gpu-d", "10.0.0.8", "ib-z"))])
    body = admin_client.get("/api/v1/nodes/gpu-d/").json()
    assert (body["fabric"], body["reported_fabric"], body["reported_address"]) == ("ib-a", "ib-z", "10.0.0.8")
    assert body["warnings"] == ["fabric set to “ib-a” but its agent reports “ib-z”"]
