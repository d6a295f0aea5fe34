"""REST API under /api/v1/: admin users only, numbers equal to cluster_summary(), constant queries."""

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from catalog.models import Alias, Profile
from dashboard.summary import cluster_summary
from reconciler.choices import Hold, ReplicaState
from reconciler.models import Replica
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client():
    user = get_user_model().objects.create_user("ops", password="pw", is_staff=True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def grow(nodes: int, tag: str):
    model = make_model(f"model-{tag}", gpus_per_node=2, min_replicas=0)
    profile = model.profiles.get()
    Alias.objects.create(model=model, name=f"alias-{tag}")
    for i in range(nodes):
        node = make_node(f"{tag}-{i}", gpus=4, fabric=f"ib-{i % 2}")
        make_replica(
            profile, placement=[(node, [0, 1])], last_used=timezone.now() - timedelta(seconds=60) if i else None
        )
    make_replica(profile, state=ReplicaState.PENDING, error="no room")


@pytest.mark.parametrize("path", ["/api/v1/status", "/api/v1/models/", "/api/v1/nodes", "/api/v1/replicas/"])
def test_api_refuses_unauthenticated_requests(path):
    assert APIClient().get(path).status_code in (401, 403)


def test_api_refuses_non_staff_users():
    user = get_user_model().objects.create_user("viewer", password="pw")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    assert client.get("/api/v1/status").status_code == 403


def test_status_is_the_cluster_summary(staff_client):
    grow(3, "a")
    response = staff_client.get("/api/v1/status")
    assert response.status_code == 200
    body, expected = response.json(), cluster_summary().as_json()
    for key in ("capacity", "free_nodes", "nodes", "replicas", "models", "unplaceable"):
        assert body[key] == expected[key]
    assert body["capacity"][0]["used"] == 6
    assert [(r["id"], r["idle_known"]) for r in body["replica_list"]] == [
        (r["id"], r["idle_known"]) for r in expected["replica_list"]
    ]


def test_replicas_report_idle_seconds_and_whether_known(staff_client):
    grow(2, "a")
    rows = staff_client.get("/api/v1/replicas").json()["results"]
    by_id = {r["id"]: r for r in rows}
    summary = {r["id"]: r for r in cluster_summary().as_json()["replica_list"]}
    assert len(rows) == 3
    for replica_id, row in by_id.items():
        assert row["idle_known"] is summary[replica_id]["idle_known"]
        assert row["nodes"] == summary[replica_id]["nodes"] and row["gpus"] == summary[replica_id]["gpus"]
        if row["idle_known"]:
            assert row["idle_seconds"] == pytest.approx(60, abs=5)
        else:
            assert row["idle_seconds"] < 0


def test_models_include_aliases_and_profiles(staff_client):
    grow(1, "a")
    body = staff_client.get("/api/v1/models/model-a").json()
    assert body["aliases"] == ["alias-a"]
    assert body["profiles"][0]["gpus_per_node"] == 2


def test_nodes_include_gpus(staff_client):
    grow(1, "a")
    body = staff_client.get("/api/v1/nodes/a-0").json()
    assert [g["index"] for g in body["gpus"]] == [0, 1, 2, 3]


def count_queries(client, path) -> int:
    with CaptureQueriesContext(connection) as queries:
        assert client.get(path).status_code == 200
    return len(queries)


@pytest.mark.parametrize("path", ["/api/v1/models", "/api/v1/nodes", "/api/v1/replicas", "/api/v1/status"])
def test_list_endpoints_run_a_constant_number_of_queries(staff_client, path):
    grow(2, "a")
    small = count_queries(staff_client, path)
    grow(20, "b")
    assert count_queries(staff_client, path) == small


def test_openapi_schema_describes_the_read_endpoints(staff_client):
    response = staff_client.get("/api/v1/schema")
    assert response.status_code == 200
    schema = response.json()
    assert schema["openapi"].startswith("3.")
    documented = " ".join(schema["paths"])
    for resource in ("status", "models", "nodes", "replicas"):
        assert f"/api/v1/{resource}" in documented


def test_a_replica_shows_its_hold_by_value(staff_client):
    grow(1, "a")
    replica = Replica.objects.order_by("id").first()
    Replica.objects.filter(pk=replica.pk).update(
        state=ReplicaState.PENDING, hold=Hold.MAKING_ROOM, placement_note="making room: stopping replica 9"
    )
    rows = {r["id"]: r for r in staff_client.get("/api/v1/replicas").json()["results"]}
    assert rows[replica.pk]["hold"] == "making_room"
    assert {r["hold"] for pk, r in rows.items() if pk != replica.pk} == {""}


def test_a_sleeping_replica_shows_its_level_host_memory_and_wake_time(staff_client):
    grow(2, "a")
    level_one, level_two = Replica.objects.order_by("id")[:2]
    now = timezone.now()
    for replica, level in ((level_one, 1), (level_two, 2)):
        Replica.objects.filter(pk=replica.pk).update(
            state=ReplicaState.SLEEPING, sleep_level=1, sleeping_level=level, sleeping_since=now, weights_bytes=7 << 30
        )
        Profile.objects.filter(pk=replica.profile_id).update(wake_seconds=2.5)
    rows = {r["id"]: r for r in staff_client.get("/api/v1/replicas", {"state": "sleeping"}).json()["results"]}
    assert [(rows[r.pk]["sleeping_level"], rows[r.pk]["host_memory_bytes"]) for r in (level_one, level_two)] == [
        (1, 7 << 30),
        (2, None),  # level 2 discarded its weights: nothing held in host memory
    ]
    assert rows[level_one.pk]["wake_seconds"] == 2.5 and rows[level_one.pk]["sleeping_since"] is not None
