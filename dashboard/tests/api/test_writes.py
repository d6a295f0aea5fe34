"""REST API writes: each happy path, and bad input answered 400 naming the field with nothing changed."""

import asyncio
from functools import partial

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from catalog.models import Alias, Model, Profile
from hub import get_hub
from inventory.models import Node
from keys.models import ApiKey
from reconciler.choices import ReplicaState
from reconciler.models import Replica
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db

PROFILE = {"engine": "vllm", "gpu_class": "H100-80GB", "gpus_per_node": 2, "max_replicas": 2}


def client_for(user=None, keyword="Token"):
    client = APIClient()
    if user is not None:
        client.credentials(HTTP_AUTHORIZATION=f"{keyword} {Token.objects.create(user=user).key}")
    return client


@pytest.fixture
def staff():
    return client_for(get_user_model().objects.create_user("ops", password="pw", is_staff=True))


def catalog_rows():
    return (
        sorted(Model.objects.values_list("name", "source", "enabled")),
        sorted(Alias.objects.values_list("name", flat=True)),
        sorted(Profile.objects.values_list("model__name", "gpus_per_node", "max_replicas", "min_replicas")),
    )


def test_create_model_with_aliases_and_profiles(staff):
    body = {"name": "llama", "source": "meta/llama", "aliases": ["ll"], "profiles": [PROFILE]}
    response = staff.post("/api/v1/models/", body, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["aliases"] == ["ll"]
    assert Profile.objects.get(model__name="llama").gpus_per_node == 2
    assert staff.get("/api/v1/models/ll").json()["name"] == "llama"  # lookup by alias


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "x", "source": "s", "profiles": [{**PROFILE, "gpus_per_node": "2"}]}, "profiles[0].gpus_per_node"),
        ({"name": "x", "source": "s", "profiles": [{**PROFILE, "min_replicas": 3}]}, "profiles[0].max_replicas"),
        ({"name": "x", "source": "s", "profiles": [{**PROFILE, "engine_args": {"a": 1}}]}, "engine_args"),
        ({"name": "bad name!", "source": "s", "profiles": [PROFILE]}, "name"),
        ({"name": "x", "profiles": [PROFILE]}, "source: missing"),
        ({"name": "x", "source": "s", "aliases": ["existing"], "profiles": [PROFILE]}, "aliases[0]"),
        ({"name": "existing", "source": "s", "profiles": [PROFILE]}, "name: “existing” is already"),
        (["not", "an", "object"], "expected a JSON object"),
    ],
)
def test_create_model_bad_input_is_a_400_naming_the_field_and_changes_nothing(staff, body, field):
    make_model("existing")
    before = catalog_rows()
    response = staff.post("/api/v1/models/", body, format="json")
    assert response.status_code == 400
    assert field in response.json()["detail"], response.json()
    assert catalog_rows() == before


def test_update_and_patch_model(staff):
    make_model("m", gpus_per_node=1)
    response = staff.patch("/api/v1/models/m", {"enabled": False, "aliases": ["m2"]}, format="json")
    assert response.status_code == 200, response.json()
    assert Model.objects.get(name="m").enabled is False
    body = {"source": "new/src", "profiles": [PROFILE, {**PROFILE, "gpu_class": "A100"}]}
    response = staff.put("/api/v1/models/m2", body, format="json")  # by alias
    assert response.status_code == 200, response.json()
    assert Model.objects.get(name="m").source == "new/src"
    assert Profile.objects.filter(model__name="m").count() == 2
    assert not Alias.objects.exists()  # PUT replaces: no aliases given


def test_update_bad_input_and_rename_change_nothing(staff):
    make_model("m")
    before = catalog_rows()
    response = staff.patch("/api/v1/models/m", {"profiles": [{**PROFILE, "gpus_per_node": 17}]}, format="json")
    assert response.status_code == 400 and "gpus_per_node" in response.json()["detail"]
    response = staff.patch("/api/v1/models/m", {"name": "other"}, format="json")
    assert response.status_code == 400 and "renamed" in response.json()["detail"]
    assert catalog_rows() == before


def test_delete_model(staff):
    make_model("m")
    assert staff.delete("/api/v1/models/m").status_code == 204
    assert not Model.objects.exists()
    assert staff.delete("/api/v1/models/m").status_code == 404


def test_cordon_uncordon_and_drain_node(staff):
    model = make_model("m", gpus_per_node=1, min_replicas=0)
    node = make_node("n1", gpus=2)
    replica = make_replica(model.profiles.get(), placement=[(node, [0])])
    assert staff.post("/api/v1/nodes/n1/cordon").json()["schedulable"] is False
    assert staff.post("/api/v1/nodes/n1/uncordon").json()["schedulable"] is True
    response = staff.post("/api/v1/nodes/n1/drain")
    assert response.status_code == 200 and response.json()["replicas_stopped"] == 1
    assert Node.objects.get(name="n1").schedulable is False
    replica.refresh_from_db()
    # Make-before-break: it serves until a replacement elsewhere is ready (reconciler/tests/lifecycle/test_node_drain.py).
    assert replica.state == ReplicaState.READY and replica.replaced_by is not None
    assert replica.stop_reason == f"node drained: serving until replica {replica.replaced_by_id} is ready"
    assert staff.post("/api/v1/nodes/nope/drain").status_code == 404


@pytest.mark.parametrize("verb", ["stop", "drain"])
def test_stop_replica(staff, verb):
    model = make_model("m", gpus_per_node=1, min_replicas=0)
    replica = make_replica(model.profiles.get(), placement=[(make_node("n1", gpus=1), [0])])
    response = staff.post(f"/api/v1/replicas/{replica.pk}/{verb}")
    assert response.status_code == 200 and response.json()["state"] == ReplicaState.STOPPING
    assert Replica.objects.get(pk=replica.pk).stop_reason.startswith(("stopped", "drained"))
    assert staff.post(f"/api/v1/replicas/{replica.pk + 99}/{verb}").status_code == 404


def test_create_list_and_revoke_api_key(staff):
    response = staff.post("/api/v1/keys/", {"name": "ci", "rpm": 60, "allowed_models": ["m"]}, format="json")
    assert response.status_code == 201
    secret = response.json()["key"]
    key = ApiKey.objects.get(name="ci")
    assert secret.startswith(key.prefix) and key.rpm == 60
    assert "key" not in staff.get("/api/v1/keys/").json()["results"][0]
    assert staff.post(f"/api/v1/keys/{key.pk}/revoke").json()["active"] is False
    assert ApiKey.objects.get(pk=key.pk).active is False


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"rpm": -1, "name": "k"}, "rpm"),
        ({"rpm": 5}, "name"),
        ({"name": "k", "allowed_models": [5]}, "allowed_models"),  # a number is not a model's name
        ({"name": "k", "allowed_pools": [""]}, "allowed_pools"),
    ],
)
def test_create_api_key_bad_input(staff, body, field):
    response = staff.post("/api/v1/keys/", body, format="json")
    assert response.status_code == 400 and field in response.json()
    assert not ApiKey.objects.exists()


@pytest.mark.parametrize("keyword", ["Token", "Bearer", "bearer"])
def test_token_auth_takes_token_and_bearer(keyword):
    user = get_user_model().objects.create_user("ops", is_staff=True)
    assert client_for(user, keyword).get("/api/v1/status").status_code == 200


def test_session_auth_for_the_browser():
    get_user_model().objects.create_user("ops", password="pw", is_staff=True)
    client = APIClient()
    assert client.login(username="ops", password="pw")
    assert client.get("/api/v1/models/").status_code == 200


def test_anonymous_is_401_and_non_staff_403_or_held_to_their_teams():
    assert APIClient().get("/api/v1/models/").status_code == 401
    assert APIClient().post("/api/v1/keys/", {"name": "k"}).status_code == 401
    user = client_for(get_user_model().objects.create_user("u"))
    assert user.post("/api/v1/models/", {"name": "m"}).status_code == 403
    # Keys are everyone's to make, in a team of theirs (dashboard/tests/api/test_self_service.py): none here.
    assert user.post("/api/v1/keys/", {"name": "k"}, format="json").status_code == 400
    assert not ApiKey.objects.exists()


@pytest.mark.parametrize("query", ["limit=0", "limit=1001", "limit=99999999999999999999", "offset=-1", "limit=x"])
def test_pagination_out_of_bounds_is_a_400(staff, query):
    response = staff.get(f"/api/v1/models/?{query}")
    assert response.status_code == 400
    assert query.split("=")[0] in response.json()


def test_pagination_within_bounds(staff):
    make_model("a")
    make_model("b")
    body = staff.get("/api/v1/models/?limit=1&offset=1").json()
    assert [m["name"] for m in body["results"]] == ["b"] and body["count"] == 2


def test_root_lists_every_endpoint(staff):
    body = staff.get("/api/v1/").json()
    assert {"models", "nodes", "replicas", "keys", "usage", "status", "schema", "docs"} <= set(body)
    assert staff.get("/api/v1/docs").status_code == 200


def test_create_api_token_command(capsys):
    get_user_model().objects.create_user("ops", is_staff=True)
    call_command("create_api_token", "ops")
    first = capsys.readouterr().out.strip()
    call_command("create_api_token", "ops")
    assert capsys.readouterr().out.strip() == first == Token.objects.get(user__username="ops").key
    get_user_model().objects.create_user("viewer")
    with pytest.raises(CommandError, match="not an active staff user"):
        call_command("create_api_token", "viewer")
    with pytest.raises(CommandError, match="no user named"):
        call_command("create_api_token", "ghost")
    assert Token.objects.count() == 1


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("get", "/api/v1/usage/?key=a%00b", None),
        ("get", "/api/v1/models/a%00b", None),
        ("post", "/api/v1/models/", {"name": "a\x00b", "source": "s", "profiles": [PROFILE]}),
    ],
)
def test_nul_characters_are_a_400_on_every_database(staff, method, path, body):
    response = getattr(staff, method)(path, body, format="json") if body else getattr(staff, method)(path)
    assert response.status_code == 400 and "NUL" in response.json()["detail"]
    assert not Model.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_revoking_through_the_api_tells_the_routers():
    """The revoke is a save, so the key's hash goes out through the hub on commit (routers drop it at once)."""
    client = client_for(get_user_model().objects.create_user("ops", is_staff=True))
    api_key, _ = ApiKey.issue("k")
    hub = get_hub()

    async def scenario():
        changes = hub.watch_key_changes()
        heard = asyncio.ensure_future(anext(changes))
        await asyncio.sleep(0.2)  # subscribed
        revoke = partial(client.post, f"/api/v1/keys/{api_key.pk}/revoke")
        response = await asyncio.get_running_loop().run_in_executor(None, revoke)
        assert response.status_code == 200
        async with asyncio.timeout(2):
            return await heard

    assert asyncio.run(scenario()) == [api_key.key_hash]


def test_key_list_runs_a_constant_number_of_queries(staff):
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert staff.get("/api/v1/keys/").status_code == 200
        return len(captured)

    ApiKey.issue("first")
    few = queries()
    for i in range(20):
        ApiKey.issue(f"k{i}", allowed_models=["m"])
    assert queries() == few


@pytest.mark.parametrize("path", ["meta-llama/Llama-3-8B", "meta-llama/Llama-3-8B/", "llama3", "llama3/"])
def test_models_are_found_by_names_with_slashes_and_by_alias(staff, path):
    model = make_model("meta-llama/Llama-3-8B")
    Alias.objects.create(model=model, name="llama3")
    response = staff.get(f"/api/v1/models/{path}")
    assert response.status_code == 200 and response.json()["name"] == "meta-llama/Llama-3-8B"
    assert staff.patch(f"/api/v1/models/{path}", {"enabled": False}, format="json").status_code == 200
    assert staff.get("/api/v1/models/meta-llama/nope").status_code == 404
