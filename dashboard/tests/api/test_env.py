"""A profile's engine env over the REST API: written with the model, read with secrets masked, the mask written
back keeps the stored value, and a bad env is a 400 naming the variable with nothing changed."""

import pytest
from django.contrib.auth import get_user_model

from catalog.models import Profile
from dashboard.tests.api.test_writes import PROFILE, catalog_rows, client_for

pytestmark = pytest.mark.django_db

SECRET = "hf_rest_secret_3307"
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_TOKEN": SECRET}


@pytest.fixture
def staff():
    return client_for(get_user_model().objects.create_user("ops", password="pw", is_staff=True))


def stored_envs():
    return list(Profile.objects.order_by("order", "id").values_list("env", flat=True))


@pytest.fixture
def tiny(staff):
    body = {"name": "tiny", "source": "/models/tiny", "profiles": [{**PROFILE, "env": ENV}, PROFILE]}
    response = staff.post("/api/v1/models/", body, format="json")
    assert response.status_code == 201, response.json()
    assert SECRET not in response.content.decode()
    return response.json()


def test_a_model_created_with_env_stores_it_and_reads_it_masked(staff, tiny):
    assert stored_envs() == [ENV, {}]
    assert [p["env"] for p in tiny["profiles"]] == [{"VLLM_CPU_KVCACHE_SPACE": "1", "HF_TOKEN": "***"}, {}]
    for url in ("/api/v1/models/tiny", "/api/v1/models/"):
        body = staff.get(url).content.decode()
        assert SECRET not in body and '"HF_TOKEN":"***"' in body.replace(" ", "")


def test_a_profile_read_and_written_back_keeps_its_secret(staff, tiny):
    profiles = staff.get("/api/v1/models/tiny").json()["profiles"]
    written = [{key: p[key] for key in PROFILE} | {"env": p["env"]} for p in profiles]
    written[0]["env"]["VLLM_CPU_KVCACHE_SPACE"] = "2"
    response = staff.patch("/api/v1/models/tiny", {"profiles": written}, format="json")
    assert response.status_code == 200, response.json()
    assert stored_envs() == [{"VLLM_CPU_KVCACHE_SPACE": "2", "HF_TOKEN": SECRET}, {}]
    # A PATCH that does not mention the profiles leaves them, secrets included, as they are.
    assert staff.patch("/api/v1/models/tiny", {"enabled": False}, format="json").status_code == 200
    assert stored_envs() == [{"VLLM_CPU_KVCACHE_SPACE": "2", "HF_TOKEN": SECRET}, {}]


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"9X": "1"}, "profiles[0].env: Variable name '9X' is not valid"),
        ({"VLLM_CPU_KVCACHE_SPACE": 1}, "profiles[0].env: Variable VLLM_CPU_KVCACHE_SPACE: the value must be a string"),
        ({"CUDA_VISIBLE_DEVICES": "1"}, "profiles[0].env: Variable CUDA_VISIBLE_DEVICES cannot be set on a profile"),
        ({"WANDB_API_KEY": "***"}, "profiles[0].env: Variable WANDB_API_KEY: “***” stands for a value already stored"),
        ("A=1", "profiles[0].env: Engine env must be a mapping of variable names to strings"),
    ],
)
def test_a_bad_env_is_a_400_naming_the_variable_and_changes_nothing(staff, tiny, env, problem):
    before = (catalog_rows(), stored_envs())
    response = staff.put(
        "/api/v1/models/tiny", {"source": "/models/tiny", "profiles": [{**PROFILE, "env": env}]}, format="json"
    )
    assert response.status_code == 400
    assert problem in response.json()["detail"], response.json()
    assert SECRET not in response.content.decode()
    assert (catalog_rows(), stored_envs()) == before


WRITTEN_VALUE = {"type": "string", "maxLength": 8192, "pattern": "^[^\\x00]*$"}


def test_the_schema_says_env_is_an_object_of_strings(staff):
    schema = staff.get("/api/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    for component, strings in (("Profile", {"type": "string"}), ("ProfileWriteRequest", WRITTEN_VALUE)):
        env = schema["components"]["schemas"][component]["properties"]["env"]
        assert env["type"] == "object" and env["additionalProperties"] == strings, (component, env)
        assert "***" in env["description"]
    assert env["maxProperties"] == 64  # as written: the agent's limits, stated
