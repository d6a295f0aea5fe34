"""Admin drain actions: a node drain cordons the node and drains its replicas (reason "node drained",
others untouched); the replica action says it drains."""

import pytest

from inventory.models import Node
from reconciler.choices import ReplicaState
from reconciler.lifecycle.drain import drain_nodes
from reconciler.models import Replica
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet():
    a, b = make_node("gpu-a"), make_node("gpu-b")
    profile = make_model("llama", max_replicas=4).profiles.get()
    on_a = make_replica(profile, placement=[(a, [0])], endpoint="http://a")
    across = make_replica(profile, placement=[(a, [1]), (b, [1])], endpoint="http://ab")
    on_b = make_replica(profile, placement=[(b, [0])], endpoint="http://b")
    return a, b, on_a, across, on_b


def test_the_node_drain_action_cordons_and_drains_its_replicas(admin_client, fleet):
    a, b, on_a, across, on_b = fleet
    response = admin_client.post(
        "/admin/inventory/node/", {"action": "drain", "_selected_action": [str(a.pk)]}, follow=True
    )
    page = response.content.decode()
    assert "Cordoned 1 node(s) and asked their 2 replica(s) to stop (reason “node drained”)" in page
    assert "keeps serving until its replacement on another node is ready" in page
    assert list(Node.objects.order_by("name").values_list("name", "schedulable")) == [
        ("gpu-a", False),
        ("gpu-b", True),
    ]
    # Serving replicas on the node stay up, each with a pending replacement (make-before-break).
    rows = dict(Replica.objects.filter(pk__in=[on_a.pk, across.pk, on_b.pk]).values_list("pk", "replaced_by__state"))
    assert rows == {on_a.pk: ReplicaState.PENDING, across.pk: ReplicaState.PENDING, on_b.pk: None}
    assert set(Replica.objects.values_list("state", flat=True)) == {ReplicaState.READY, ReplicaState.PENDING}


def test_draining_a_node_without_replicas_only_cordons_it():
    node = make_node("gpu-c")
    assert drain_nodes([node.pk]) == (1, 0)
    node.refresh_from_db()
    assert node.schedulable is False


def test_the_node_admin_lists_drain_with_the_other_actions(admin_client):
    make_node("gpu-a")  # the action menu shows only over rows
    page = admin_client.get("/admin/inventory/node/").content.decode()
    for action in ("cordon", "uncordon", "declare_lost", "drain"):
        assert f'value="{action}"' in page
    assert "Drain: cordon the selected nodes and drain and stop their replicas" in page


def test_the_replica_action_says_it_drains(admin_client, fleet):
    on_a = fleet[2]
    page = admin_client.get("/admin/reconciler/replica/").content.decode()
    assert "Drain and stop the selected replicas" in page
    response = admin_client.post(
        "/admin/reconciler/replica/", {"action": "stop_replicas", "_selected_action": [str(on_a.pk)]}, follow=True
    )
    assert "drains them" in response.content.decode()
    on_a.refresh_from_db()
    assert (on_a.state, on_a.stop_reason) == (ReplicaState.STOPPING, "stopped by an operator")
