"""The partition brake on every operator surface: summary, ctl_status, /admin, /metrics, the admin action."""

from io import StringIO

import pytest
from django.core.management import call_command
from django.urls import reverse

from dashboard.summary import cluster_summary
from inventory.choices import NodeState
from inventory.models import Node
from tests.fleet import make_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def partitioned(settings):
    """2 of 4 nodes silent: above the brake's 0.3."""
    settings.LLMGW_PARTITION_BRAKE_FRACTION = 0.3
    make_node("gpu-a", gpus=1)
    make_node("gpu-b", gpus=1)
    make_node("gpu-c", gpus=1, state=NodeState.UNREACHABLE)
    make_node("gpu-d", gpus=1, state=NodeState.UNREACHABLE)


def test_the_summary_says_when_the_brake_holds(partitioned):
    assert cluster_summary().as_json()["partition_brake"] == {
        "engaged": True,
        "silent_nodes": 2,
        "watched_nodes": 4,
        "fraction": 0.3,
    }
    Node.objects.filter(name="gpu-d").update(state=NodeState.READY)
    assert cluster_summary().as_json()["partition_brake"]["engaged"] is False


def test_ctl_status_and_the_dashboard_show_the_brake(partitioned, admin_client):
    out = StringIO()
    call_command("ctl_status", stdout=out)
    assert "partition brake: 2 of 4 nodes are silent" in out.getvalue()
    page = admin_client.get(reverse("admin:index")).content.decode()
    assert 'id="partition-brake"' in page and "2 of 4 nodes are silent" in page


def test_metrics_carry_the_brake(partitioned, client):
    body = client.get("/metrics").content.decode()
    assert "llmgw_partition_brake 1.0" in body


def test_declare_lost_action_marks_only_unreachable_nodes_lost(partitioned, admin_client):
    nodes = Node.objects.filter(name__in=["gpu-a", "gpu-c"]).values_list("pk", flat=True)
    response = admin_client.post(
        reverse("admin:inventory_node_changelist"),
        {"action": "declare_lost", "_selected_action": [str(pk) for pk in nodes]},
        follow=True,
    )
    assert response.status_code == 200
    states = dict(Node.objects.values_list("name", "state"))
    assert states == {"gpu-a": "ready", "gpu-b": "ready", "gpu-c": "lost", "gpu-d": "unreachable"}
