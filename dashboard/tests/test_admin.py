"""The /admin dashboard and the inventory, reconciler and router admin pages."""

import re

import pytest
from django.urls import reverse

from hub.credentials import hash_secret
from inventory.models import GPU, Node, NodeCredential
from keys.models import ApiKey
from reconciler.choices import ReplicaState
from reconciler.models import Lease
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet():
    a = make_node("gpu-a", gpus=8, fabric="ib-a")
    make_node("gpu-b", gpus=8, fabric="ib-b")
    profile = make_model("llama-70b", gpus_per_node=4, min_replicas=0).profiles.get()
    big = make_model("big-405b", gpus_per_node=8, nodes_per_replica=2, min_replicas=0).profiles.get()
    replica = make_replica(profile, placement=[(a, [0, 1, 2, 3])], endpoint="http://127.0.0.1:21000")
    make_replica(big, state=ReplicaState.PENDING, error="needs 2 whole H100-80GB nodes on one fabric")
    return replica


def test_dashboard_redirects_anonymous_users_to_login(client):
    response = client.get("/admin/")
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


def test_dashboard_shows_capacity_free_nodes_unplaceable_and_idle_for_staff(admin_client, fleet):
    response = admin_client.get("/admin/")
    html = response.content.decode()
    assert response.status_code == 200
    assert 'data-panels-url="/admin/panels/"' in html
    assert "4/16 used" in html and "12 free" in html
    assert 'class="used" style="width: 25.00%"' in html
    assert "needs 2 whole H100-80GB nodes on one fabric" in html
    row = re.search(rf"<tr><td>{fleet.pk}</td>.*?</tr>", html, re.S).group(0)
    assert "gpu-a" in row and "http://127.0.0.1:21000" in row and "<td>-</td></tr>" in row
    # The usual app list is still there below the dashboard.
    assert "/admin/catalog/model/" in html


def test_cordon_and_uncordon_actions_flip_schedulable(admin_client, fleet):
    nodes = list(Node.objects.values_list("pk", flat=True))
    url = reverse("admin:inventory_node_changelist")
    admin_client.post(url, {"action": "cordon", "_selected_action": nodes})
    assert not Node.objects.filter(schedulable=True).exists()
    admin_client.post(url, {"action": "uncordon", "_selected_action": nodes[:1]})
    assert list(Node.objects.filter(schedulable=True).values_list("pk", flat=True)) == nodes[:1]


def test_node_list_shows_gpu_count_by_class(admin_client, fleet):
    html = admin_client.get(reverse("admin:inventory_node_changelist")).content.decode()
    assert "8×H100-80GB" in html


def test_gpus_and_credentials_cannot_be_added_or_edited_by_hand(admin_client, fleet):
    NodeCredential.objects.create(node=Node.objects.first(), token_hash=hash_secret("t"), prefix="llmgw-node-abc")
    assert admin_client.get(reverse("admin:inventory_gpu_add")).status_code == 403
    assert admin_client.get(reverse("admin:inventory_nodecredential_add")).status_code == 403
    cred = NodeCredential.objects.get()
    url = reverse("admin:inventory_nodecredential_change", args=[cred.pk])
    admin_client.post(url, {"prefix": "changed"})
    assert NodeCredential.objects.get().prefix == "llmgw-node-abc"
    gpu = GPU.objects.first()
    admin_client.post(reverse("admin:inventory_gpu_change", args=[gpu.pk]), {"gpu_class": "changed"})
    assert GPU.objects.get(pk=gpu.pk).gpu_class == "H100-80GB"


def test_node_credential_can_be_deleted(admin_client, fleet):
    cred = NodeCredential.objects.create(node=Node.objects.first(), token_hash=hash_secret("t"), prefix="p")
    admin_client.post(reverse("admin:inventory_nodecredential_delete", args=[cred.pk]), {"post": "yes"})
    assert not NodeCredential.objects.exists()


def test_replica_list_shows_nodes_and_a_dash_for_unknown_idle(admin_client, fleet):
    html = admin_client.get(reverse("admin:reconciler_replica_changelist")).content.decode()
    row = re.search(r'<td class="field-node_names">gpu-a</td>.*?<td class="field-idle_for">(.*?)</td>', html, re.S)
    assert row.group(1) == "-"


def test_lease_admin_allows_no_add_change_or_delete(admin_client, settings):
    lease = Lease.objects.create(name=settings.LLMGW_LEASE_NAME, owner="cp-1", epoch=3, expires_at=0.0)
    assert admin_client.get(reverse("admin:reconciler_lease_add")).status_code == 403
    assert (
        admin_client.post(reverse("admin:reconciler_lease_delete", args=[lease.pk]), {"post": "yes"}).status_code == 403
    )
    admin_client.post(reverse("admin:reconciler_lease_change", args=[lease.pk]), {"owner": "me", "epoch": 9})
    assert Lease.objects.get().owner == "cp-1"
    assert "expired" in admin_client.get(reverse("admin:reconciler_lease_changelist")).content.decode()


def test_adding_an_api_key_shows_the_plaintext_once_and_stores_only_its_hash(admin_client):
    response = admin_client.post(reverse("admin:keys_apikey_add"), {"name": "team-a"}, follow=True)
    html = response.content.decode()
    key = re.search(r"sk-llmgw-[A-Za-z0-9_-]{20,}", html).group(0)
    assert html.count(key) == 1 and "will not be shown again" in html
    api_key = ApiKey.objects.get()
    assert api_key.name == "team-a" and api_key.active
    assert api_key.key_hash == hash_secret(key)
    assert key.startswith(api_key.prefix)
    assert all(key not in str(value) for value in ApiKey.objects.values_list().get())
    # Shown once: the next page does not carry it.
    assert key not in admin_client.get(reverse("admin:keys_apikey_changelist")).content.decode()
    assert key not in admin_client.get(reverse("admin:keys_apikey_change", args=[api_key.pk])).content.decode()


def test_api_key_add_form_asks_only_for_a_name(admin_client):
    html = admin_client.get(reverse("admin:keys_apikey_add")).content.decode()
    assert 'name="name"' in html and 'name="key_hash"' not in html and 'name="prefix"' not in html


def test_revoke_action_deactivates_keys(admin_client):
    kept, _ = ApiKey.issue("kept")
    revoked, _ = ApiKey.issue("revoked")
    admin_client.post(reverse("admin:keys_apikey_changelist"), {"action": "revoke", "_selected_action": [revoked.pk]})
    assert list(ApiKey.objects.active().values_list("name", flat=True)) == ["kept"]


def test_stop_replicas_action_marks_placed_replicas_stopping(admin_client, fleet):
    url = reverse("admin:reconciler_replica_changelist")
    response = admin_client.post(url, {"action": "stop_replicas", "_selected_action": [fleet.pk]}, follow=True)
    fleet.refresh_from_db()
    assert fleet.state == ReplicaState.STOPPING
    assert "Asked 1 replica(s) to stop" in response.content.decode()


def test_node_admin_edits_fabric_but_not_the_enrolled_name(admin_client, fleet):
    node = Node.objects.get(name="gpu-a")
    assert admin_client.get(reverse("admin:inventory_node_add")).status_code == 403
    data = {"name": "stolen", "address": "10.0.0.9", "fabric": "ib-z", "labels": "{}", "schedulable": "on"}
    data.update(
        {"gpus-TOTAL_FORMS": "8", "gpus-INITIAL_FORMS": "8", "gpus-MIN_NUM_FORMS": "0", "gpus-MAX_NUM_FORMS": "0"}
    )
    data.update({"weights-TOTAL_FORMS": "0", "weights-INITIAL_FORMS": "0"})
    data.update({f"gpus-{i}-id": str(pk) for i, pk in enumerate(node.gpus.values_list("pk", flat=True))})
    data.update({f"gpus-{i}-node": str(node.pk) for i in range(8)})
    response = admin_client.post(reverse("admin:inventory_node_change", args=[node.pk]), data)
    assert response.status_code == 302, response.content.decode()[:2000]
    node.refresh_from_db()
    assert (node.name, node.fabric, node.address) == ("gpu-a", "ib-z", "10.0.0.9")
