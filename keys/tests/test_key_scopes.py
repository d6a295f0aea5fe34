"""A key's scope and expiry, over real HTTP through the router: 403 outside its models (named or aliased),
/v1/models and /v1/models/{id} show only its models, and an expired key is 401 from the instant it expires."""

import datetime as dt
import time

import httpx
import pytest
from django.utils import timezone

from keys.models import ApiKey
from router.key_cache import KeyInfo
from router.tests.conftest import ALIAS, MODEL, make_table

pytestmark = pytest.mark.django_db(transaction=True)

OTHER = "qwen-7b"
OTHER_ALIAS = "qwen"
MODELS = {MODEL: {"aliases": [ALIAS]}, OTHER: {"aliases": [OTHER_ALIAS]}}


class WallClock:
    """The wall clock, or a fixed instant once a test sets `now`."""

    def __init__(self) -> None:
        self.now: float | None = None

    def __call__(self) -> float:
        return time.time() if self.now is None else self.now


@pytest.fixture
def wall_clock():
    return WallClock()


@pytest.fixture
def router(start_router, hub, start_engine, wall_clock):
    engine = start_engine()
    table = make_table([engine.url, {"url": engine.url, "model": OTHER, "replica_id": "9"}], models=MODELS)
    hub.publish_endpoints(table)
    return start_router(clock=wall_clock)


def key(**fields) -> dict:
    return {"Authorization": f"Bearer {ApiKey.issue('team-a', **fields)[1]}"}


def chat(router, headers, model):
    return httpx.post(
        f"{router.url}/v1/chat/completions",
        headers=headers,
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )


@pytest.mark.parametrize("scope", [[MODEL], [ALIAS]], ids=["scope-by-name", "scope-by-alias"])
@pytest.mark.parametrize("asked", [MODEL, ALIAS], ids=["asked-by-name", "asked-by-alias"])
def test_a_scoped_key_may_use_its_model_by_name_or_alias_whichever_its_scope_names(router, scope, asked):
    assert chat(router, key(allowed_models=scope), asked).status_code == 200


@pytest.mark.parametrize("asked", [OTHER, OTHER_ALIAS])
def test_a_model_outside_the_keys_scope_is_403_in_openai_shape(router, asked):
    response = chat(router, key(allowed_models=[ALIAS]), asked)
    assert response.status_code == 403
    assert response.json() == {
        "error": {
            "message": f"The API key “team-a” may not use the model `{OTHER}`.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_allowed",
        }
    }


def test_a_key_without_scope_may_use_every_model(router):
    headers = key()
    assert chat(router, headers, MODEL).status_code == chat(router, headers, OTHER).status_code == 200


def test_an_unknown_model_is_still_404_for_a_scoped_key(router):
    assert chat(router, key(allowed_models=[MODEL]), "nope").status_code == 404


def test_model_list_shows_only_the_keys_models_with_their_aliases(router):
    listed = httpx.get(f"{router.url}/v1/models", headers=key(allowed_models=[OTHER_ALIAS])).json()
    assert [m["id"] for m in listed["data"]] == [OTHER, OTHER_ALIAS]
    everything = httpx.get(f"{router.url}/v1/models", headers=key()).json()
    assert [m["id"] for m in everything["data"]] == [MODEL, ALIAS, OTHER, OTHER_ALIAS]


@pytest.mark.parametrize("name", [MODEL, ALIAS])
def test_one_model_is_retrieved_by_name_or_alias(router, name):
    response = httpx.get(f"{router.url}/v1/models/{name}", headers=key(allowed_models=[MODEL]))
    assert response.status_code == 200
    assert response.json() == {"id": name, "object": "model", "created": 0, "owned_by": "llmgw", "root": MODEL}


@pytest.mark.parametrize("name", [OTHER, OTHER_ALIAS, "nope"])
def test_a_model_outside_the_scope_or_unknown_is_404_on_retrieve(router, name):
    response = httpx.get(f"{router.url}/v1/models/{name}", headers=key(allowed_models=[MODEL]))
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": f"The model `{name}` does not exist.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_retrieving_a_model_needs_a_key_and_a_get(router):
    assert httpx.get(f"{router.url}/v1/models/{MODEL}").status_code == 401
    response = httpx.delete(f"{router.url}/v1/models/{MODEL}", headers=key())
    assert response.status_code == 405 and response.headers["allow"] == "GET"


def test_an_expired_key_is_401_naming_the_expiry(router):
    headers = key(expires_at=timezone.now() - dt.timedelta(seconds=1))
    response = chat(router, headers, MODEL)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "expired_api_key" and "“team-a” expired at" in error["message"]
    assert httpx.get(f"{router.url}/v1/models", headers=headers).status_code == 401


def test_a_cached_key_is_refused_from_the_instant_it_expires_without_a_new_lookup(router, wall_clock):
    expiry = timezone.now() + dt.timedelta(minutes=5)
    headers = key(expires_at=expiry)
    wall_clock.now = expiry.timestamp() - 0.001
    assert chat(router, headers, MODEL).status_code == 200
    lookups = router.state.keys.lookups
    wall_clock.now = expiry.timestamp()
    assert chat(router, headers, MODEL).status_code == 401
    assert router.state.keys.lookups == lookups  # the expiry was checked against the cached value


def test_key_info_scope_resolves_both_sides():
    names = {MODEL: MODEL, ALIAS: MODEL, OTHER: OTHER}
    info = KeyInfo(1, "k", "d", allowed_models=frozenset({ALIAS}))
    assert info.allows(MODEL, names.get) and not info.allows(OTHER, names.get)
    assert KeyInfo(1, "k", "d").allows(OTHER, names.get)
    assert not KeyInfo(1, "k", "d", allowed_models=frozenset({"gone"})).allows(MODEL, names.get)
