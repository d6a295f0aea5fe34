"""POST /api/v1/plan: the planner's answer, staff only, 400 naming the problem, no writes, fixed queries."""

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from catalog.models import Model, Profile
from dashboard.api.plan import PlanAnswerSerializer
from inventory.models import GPU, Node
from reconciler.models import GPUAssignment, Replica, Shard
from reconciler.planner.what_if import entries_from_data, plan
from tests.fleet import make_model, make_node, make_replica, watch_usage

pytestmark = pytest.mark.django_db

URL = "/api/v1/plan"
NEWCOMER = {
    "name": "newcomer",
    "source": "org/newcomer",
    "parameters_billions": 7.0,
    "dtype": "bfloat16",
    "profiles": [{"gpu_class": "H100-80GB", "gpus_per_node": 8, "min_replicas": 0}],
}


@pytest.fixture
def staff_client():
    user = get_user_model().objects.create_user("ops", password="pw", is_staff=True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {Token.objects.create(user=user).key}")
    return client


def busy_fleet(nodes: int, tag: str):
    """`nodes` full 8-GPU nodes, each running one idle replica of its own model."""
    for i in range(nodes):
        node = make_node(f"{tag}-{i}", fabric="ib-a")
        replica = make_replica(
            make_model(f"{tag}-m{i}", gpus_per_node=8, min_replicas=0, idle_timeout_seconds=0).profiles.get(),
            placement=[(node, range(8))],
            last_used=timezone.now() - timedelta(seconds=3000 + i),
        )
        Replica.objects.filter(pk=replica.pk).update(ready_at=timezone.now() - timedelta(hours=1))


def rows():
    return [table.objects.count() for table in (Model, Profile, Node, GPU, Replica, Shard, GPUAssignment)]


def test_the_answer_has_the_planners_shape_and_changes_nothing(staff_client):
    watch_usage(known_since=timezone.now() - timedelta(hours=1))
    busy_fleet(2, "busy")
    make_model("llama", gpus_per_node=8)
    before = rows()

    response = staff_client.post(URL, {"models": [NEWCOMER], "names": ["llama"]}, format="json")

    assert response.status_code == 200, response.content
    first, second = response.json()["models"]
    assert (first["name"], first["verdict"], first["profile"]) == ("newcomer", "fits_after_stopping", 0)
    assert [s["model"] for s in first["stop"]] == ["busy-m1"]  # the least recently used
    assert set(first["stop"][0]) >= {"replica", "model", "gpu_class", "gpu_count", "nodes", "frees"}
    assert first["needs_gib_per_gpu"] is not None and first["where"] == [{"node": "busy-1", "gpus": list(range(8))}]
    # Cumulative: the other busy replica is the only one left for the second.
    assert [s["model"] for s in second["stop"]] == ["busy-m0"]
    assert rows() == before


def test_the_answer_is_what_its_schema_serializer_says():
    watch_usage(known_since=timezone.now() - timedelta(hours=1))
    busy_fleet(1, "busy")
    answer = plan(entries_from_data({"models": [NEWCOMER, {**NEWCOMER, "name": "other"}]}), timezone.now())

    assert PlanAnswerSerializer(answer).data == answer.to_json()


@pytest.mark.parametrize(
    ("body", "field", "text"),
    [
        ({}, "detail", "nothing to plan"),
        ({"names": ["nope"]}, "names", "no catalog model or alias named 'nope'"),
        ({"models": [{"name": "x", "source": "org/x", "profiles": [{}]}]}, "models", "gpu_class: missing"),
        ({"models": ["not a mapping"]}, "models", "Expected a dictionary"),
        ({"names": "llama"}, "names", "Expected a list"),
        ({"names": ["a\x00b"]}, "detail", "NUL"),
    ],
)
def test_bad_bodies_are_400s_naming_the_problem(staff_client, body, field, text):
    response = staff_client.post(URL, body, format="json")
    assert response.status_code == 400
    assert text in str(response.json()[field])


def test_only_staff_may_plan():
    assert APIClient().post(URL, {"names": ["x"]}, format="json").status_code == 401
    user = get_user_model().objects.create_user("dev", password="pw")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {Token.objects.create(user=user).key}")
    assert client.post(URL, {"names": ["x"]}, format="json").status_code == 403


def test_the_query_count_does_not_grow_with_the_fleet(staff_client):
    watch_usage(known_since=timezone.now() - timedelta(hours=1))
    counts = []
    for size, tag in ((1, "a"), (8, "b")):
        busy_fleet(size, tag)
        with CaptureQueriesContext(connection) as queries:
            response = staff_client.post(URL, {"models": [NEWCOMER], "names": [f"{tag}-m0"]}, format="json")
        assert response.status_code == 200
        assert all(q["sql"].lstrip().upper().startswith("SELECT") for q in queries.captured_queries)
        counts.append(len(queries))
    assert counts[0] == counts[1]


def test_the_schema_documents_the_plan(staff_client):
    schema = staff_client.get("/api/v1/schema").json()
    operation = schema["paths"]["/api/v1/plan/"]["post"]
    assert set(operation["responses"]) >= {"200", "400", "401", "403"}
    answer = schema["components"]["schemas"]["PlanAnswer"]["properties"]
    assert set(answer) == {"models", "usage_known", "usage_reason"}
    assert "names" in schema["components"]["schemas"]["PlanRequestRequest"]["properties"]
