"""The dashboard's "Will it fit?" form: staff only, CSRF protected, shows the planner's answer, writes nothing."""

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from reconciler.models import Replica
from tests.fleet import make_model, make_node, make_replica, watch_usage

pytestmark = pytest.mark.django_db

URL = "/admin/plan/"
ENTRY = """
name: newcomer
source: org/newcomer
parameters_billions: 70.0
dtype: bfloat16
profiles:
  - {gpu_class: H100-80GB, gpus_per_node: 8, min_replicas: 0, max_model_len: 8192}
"""


def test_only_staff_see_the_form(client):
    assert client.get(URL).status_code == 302  # to the login page
    user = get_user_model().objects.create_user("dev", password="pw")
    client.force_login(user)
    assert client.get(URL).status_code == 302
    assert client.post(URL, {"entry": ENTRY}).status_code == 302


def test_the_index_links_to_the_form(admin_client):
    assert 'href="/admin/plan/"' in admin_client.get("/admin/").content.decode()


def test_a_pasted_entry_shows_verdict_needs_and_what_to_stop(admin_client):
    watch_usage(known_since=timezone.now() - timedelta(hours=1))
    node = make_node("gpu-a", fabric="ib-a")
    idle = make_replica(
        make_model("old", gpus_per_node=8, min_replicas=0, idle_timeout_seconds=0).profiles.get(),
        placement=[(node, range(8))],
        last_used=timezone.now() - timedelta(hours=2),
    )
    Replica.objects.filter(pk=idle.pk).update(ready_at=timezone.now() - timedelta(hours=3))

    response = admin_client.post(URL, {"entry": ENTRY})

    html = response.content.decode()
    assert response.status_code == 200
    assert '<span class="verdict-fits_after_stopping">fits_after_stopping</span>' in html
    assert "on profiles[0] H100-80GB×8" in html
    assert "<th>Needs per GPU</th><td>18.8 GiB</td>" in html
    assert f"<td>{idle.pk}</td><td>old</td>" in html and "8 H100-80GB GPUs on gpu-a (the whole node" in html
    assert Replica.objects.get(pk=idle.pk).state == "ready"  # nothing written


def test_a_catalog_model_can_be_picked(admin_client):
    make_node("gpu-a", gpus=4)
    make_model("llama", gpus_per_node=2)

    html = admin_client.post(URL, {"model": "llama"}).content.decode()

    assert '<span class="verdict-fits">fits</span>' in html and "gpu-a GPUs 0,1" in html


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "Pick a catalog model or paste a catalog-format YAML entry."),
        ({"entry": "name: [\n"}, "the file is not valid YAML"),
        ({"entry": "name: x\nsource: org/x\nprofiles: [{}]\n"}, "gpu_class: missing (required)"),
        ({"model": "nope"}, "Select a valid choice"),
    ],
)
def test_bad_input_is_shown_on_the_form(admin_client, data, message):
    response = admin_client.post(URL, data)
    assert response.status_code == 200
    assert message in response.content.decode()
    assert "verdict-" not in response.content.decode().split("</form>")[1]


def test_the_form_is_csrf_protected():
    user = get_user_model().objects.create_user("ops", password="pw", is_staff=True)
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    assert client.post(URL, {"entry": ENTRY}).status_code == 403
    page = client.get(URL)
    assert 'name="csrfmiddlewaretoken"' in page.content.decode()
