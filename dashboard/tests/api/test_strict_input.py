"""The REST API takes a value only as its schema types it, and the schema states what the API refuses.

schemathesis checks the same in general (test_api_schemathesis, tests/e2e/test_schemathesis);
these name the cases it once found and the rules the schema states.
"""

import pytest
from django.contrib.auth import get_user_model

from catalog.catalog_file import read_models
from catalog.models import Model
from dashboard.tests.api.test_writes import PROFILE, client_for
from keys.models import ApiKey
from tests.fleet import make_model

pytestmark = pytest.mark.django_db

NO_NUL = "^[^\\x00]*$"


@pytest.fixture
def staff():
    return client_for(get_user_model().objects.create_user("ops", password="pw", is_staff=True))


@pytest.fixture
def schema(staff):
    return staff.get("/api/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"name": 0}, "name: expected a string, got a number (0)"),
        ({"name": "k", "rpm": "60"}, "rpm: expected an integer, got a string ('60')"),
        ({"name": "k", "tpm": 1.0}, "tpm: expected an integer, got a number (1.0)"),
        ({"name": "k", "rpm": 2**31}, "rpm: Ensure this value is less than or equal to 2147483647."),
        ({"name": "k", "allowed_pools": [5]}, "allowed_pools: {'0': ['expected a string, got a number (5)']}"),
        ({"name": "k", "expires_at": "2030-01-01"}, "expires_at: expected an RFC 3339 date-time"),
        ({"name": "k", "expires_at": "2030-01-01T00:00:00"}, "expires_at: expected an RFC 3339 date-time"),
        ({"name": "k", "rmp": 60}, "rmp: unknown key"),
    ],
)
def test_a_key_body_the_schema_refuses_is_a_400_naming_the_field(staff, body, problem):
    response = staff.post("/api/v1/keys/", body, format="json")
    assert response.status_code == 400
    field, message = problem.split(": ", 1)
    errors = response.json()[field]
    assert any(message in text for text in errors) if isinstance(errors, list) else str(errors) == message, errors
    assert not ApiKey.objects.exists()


def test_a_key_name_is_taken_as_sent_and_an_rfc_3339_expiry_in_either_case(staff):
    response = staff.post("/api/v1/keys/", {"name": "  ", "expires_at": "2030-01-01t00:00:00z"}, format="json")
    assert response.status_code == 201, response.json()
    assert ApiKey.objects.get().name == "  "


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"parameters_billions": {}, "dtype": "fp8"}, "parameters_billions: expected a number, got an object"),
        ({"enabled": "yes"}, "enabled: expected true or false, got a string ('yes')"),
        ({"profiles": [{**PROFILE, "sleep_level": "1"}]}, "profiles[0].sleep_level: expected one of"),
        ({"profiles": [{**PROFILE, "engine_args": ["--x", 5]}]}, "profiles[0].engine_args[1]: expected a string"),
        ({"aliases": ["ok", "bad name!"]}, "aliases[1]: Use letters, digits"),
        ({"adapters": [{"name": "a", "source": "s", "rank": "8"}]}, "adapters[0].rank: expected an integer"),
        ({"profile": []}, "profile: unknown key"),
    ],
)
@pytest.mark.parametrize("method", ["post", "put", "patch"])
def test_a_model_body_the_schema_refuses_is_a_400_naming_the_field(staff, method, change, problem):
    make_model("m")
    url = "/api/v1/models/" if method == "post" else "/api/v1/models/m"
    base = {"name": "new", "source": "s", "profiles": [PROFILE]} if method == "post" else {}
    response = getattr(staff, method)(url, {**base, **change}, format="json")
    assert response.status_code == 400
    assert any(error.startswith(problem) for error in response.json()["errors"]), response.json()
    assert list(Model.objects.values_list("name", "enabled")) == [("m", True)]


def test_a_catalog_file_refuses_a_size_that_is_no_number():
    problems: list[str] = []
    read_models({"models": [{"name": "x", "source": "s", "parameters_billions": {}, "profiles": []}]}, problems)
    assert problems == ['models[0] "x": parameters_billions: expected a number, got a mapping']


def test_an_empty_engine_argument_is_taken_as_the_schema_allows(staff):
    body = {"name": "m", "source": "s", "profiles": [{**PROFILE, "engine_args": ["--chat-template", ""]}]}
    response = staff.post("/api/v1/models/", body, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["profiles"][0]["engine_args"] == ["--chat-template", ""]


def test_put_may_leave_out_the_name_and_the_schema_says_so(staff, schema):
    make_model("m")
    response = staff.put("/api/v1/models/m", {"source": "t", "profiles": [PROFILE]}, format="json")
    assert response.status_code == 200, response.json()
    components = schema["components"]["schemas"]
    assert "name" in components["ModelWriteRequest"]["required"]
    assert "name" not in components["ModelReplaceRequest"]["required"]


def test_plan_names_must_be_strings(staff):
    response = staff.post("/api/v1/plan", {"names": [5]}, format="json")
    assert response.status_code == 400 and "expected a string" in str(response.json()["names"])


def test_the_schema_refuses_unknown_keys_and_nul_in_every_input(schema):
    components = schema["components"]["schemas"]
    requests = [name for name in components if name.endswith("Request")]
    assert {"ModelWriteRequest", "ProfileWriteRequest", "ApiKeyWriteRequest", "PlanRequestRequest"} <= set(requests)
    for name in requests:
        assert components[name]["additionalProperties"] is False, name
    assert components["ApiKeyWriteRequest"]["properties"]["name"]["pattern"] == NO_NUL
    assert components["ModelWriteRequest"]["properties"]["profiles"]["items"] == {
        "$ref": "#/components/schemas/ProfileWriteRequest"
    }
    usage = schema["paths"]["/api/v1/usage/"]["get"]["parameters"]
    assert {p["name"]: p["schema"].get("pattern") for p in usage if p["name"] in ("key", "model")} == {
        "key": NO_NUL,
        "model": NO_NUL,
    }
    name = schema["paths"]["/api/v1/models/{name}/"]["get"]["parameters"][0]["schema"]
    assert name["pattern"] == "^[^\\x00]+$"


def test_the_schema_documents_the_catalog_rules_of_model_writes_and_plan(schema):
    for path, method in [("/api/v1/models/", "post"), ("/api/v1/models/{name}/", "put"), ("/api/v1/plan/", "post")]:
        refused = schema["paths"][path][method]["responses"]["400"]
        assert "max_replicas >= min_replicas" in refused["description"], (path, method)
    since = next(p for p in schema["paths"]["/api/v1/usage/"]["get"]["parameters"] if p["name"] == "since")
    assert [s["format"] for s in since["schema"]["anyOf"]] == ["date-time", "date"]
