"""Catalog admin: alias clashes and impossible profiles are form errors, and nothing is saved."""

import pytest
from django.urls import reverse

from catalog.models import Alias, Model, Profile

pytestmark = pytest.mark.django_db

ADD_URL = "/admin/catalog/model/add/"


def model_form(name, aliases=(), profiles=(), *, alias_initial=(), source="org/weights", adapters=(), prices=()):
    """POST data for the model change form with its alias, profile and adapter inlines.

    `alias_initial` lists (pk, name) of existing aliases, sent first as the formset expects; `prices` the
    (input, output) price boxes, sent as the form shows them by default (0) when not given.
    """
    price_in, price_out = prices or ("0", "0")
    data = {
        "name": name,
        "source": source,
        "enabled": "on",
        "price_input_per_million": price_in,
        "price_output_per_million": price_out,
    }
    alias_rows = [{"id": str(pk), "name": n} for pk, n in alias_initial] + [{"id": "", "name": n} for n in aliases]
    data.update(
        {
            "aliases-TOTAL_FORMS": str(len(alias_rows)),
            "aliases-INITIAL_FORMS": str(len(alias_initial)),
            "aliases-MIN_NUM_FORMS": "0",
            "aliases-MAX_NUM_FORMS": "1000",
        }
    )
    for i, row in enumerate(alias_rows):
        data.update({f"aliases-{i}-{k}": v for k, v in row.items()})
    data.update(
        {
            "profiles-TOTAL_FORMS": str(len(profiles)),
            "profiles-INITIAL_FORMS": "0",
            "profiles-MIN_NUM_FORMS": "0",
            "profiles-MAX_NUM_FORMS": "1000",
        }
    )
    for i, overrides in enumerate(profiles):
        profile = {
            "order": "0",
            "engine": "vllm",
            "gpu_class": "H100-80GB",
            "gpus_per_node": "1",
            "nodes_per_replica": "1",
            "min_replicas": "0",
            "max_replicas": "1",
            "target_concurrency": "8",
            "priority": "0",
            "pool": "default",
            "weight": "1",
            "idle_timeout_seconds": "",
            "engine_args": "[]",
            **overrides,
        }
        data.update({f"profiles-{i}-{k}": v for k, v in profile.items()})
    data.update(
        {
            "adapters-TOTAL_FORMS": str(len(adapters)),
            "adapters-INITIAL_FORMS": "0",
            "adapters-MIN_NUM_FORMS": "0",
            "adapters-MAX_NUM_FORMS": "1000",
        }
    )
    for i, row in enumerate(adapters):
        adapter = {"name": "", "source": "", "enabled": "on", "rank": "", "aliases": "[]", **row}
        data.update({f"adapters-{i}-{k}": v for k, v in adapter.items()})
    return data


@pytest.fixture
def llama():
    model = Model.objects.create(name="llama-70b", source="meta/llama")
    Alias.objects.create(model=model, name="llama")
    return model


def snapshot():
    return (
        sorted(Model.objects.values_list("name", flat=True)),
        sorted(Alias.objects.values_list("name", "model__name")),
        Profile.objects.count(),
    )


def test_valid_model_with_alias_and_profile_is_saved(admin_client):
    response = admin_client.post(
        ADD_URL, model_form("qwen-7b", aliases=["qwen"], profiles=[{"engine_args": '["--x"]'}])
    )
    assert response.status_code == 302
    model = Model.objects.get(name="qwen-7b")
    assert list(model.aliases.values_list("name", flat=True)) == ["qwen"]
    assert model.profiles.get().engine_args == ["--x"]


def test_alias_equal_to_another_models_name_is_refused_and_nothing_saved(admin_client, llama):
    before = snapshot()
    response = admin_client.post(ADD_URL, model_form("qwen-7b", aliases=["llama-70b"], profiles=[{}]))
    assert response.status_code == 200
    assert "“llama-70b” is already the name of model “llama-70b”" in response.content.decode()
    assert snapshot() == before


def test_alias_already_used_by_another_model_is_refused_and_nothing_saved(admin_client, llama):
    before = snapshot()
    response = admin_client.post(ADD_URL, model_form("qwen-7b", aliases=["llama"]))
    assert response.status_code == 200
    assert "“llama” is already an alias of model “llama-70b”" in response.content.decode()
    assert snapshot() == before


def test_model_name_equal_to_an_existing_alias_is_refused_and_nothing_saved(admin_client, llama):
    before = snapshot()
    response = admin_client.post(ADD_URL, model_form("llama", aliases=["fresh"]))
    assert response.status_code == 200
    assert "“llama” is already an alias of model “llama-70b”" in response.content.decode()
    assert snapshot() == before


def test_alias_equal_to_the_new_models_own_name_is_refused(admin_client):
    response = admin_client.post(ADD_URL, model_form("qwen-7b", aliases=["qwen-7b"]))
    assert response.status_code == 200
    assert "“qwen-7b” is this model&#x27;s own name" in response.content.decode()
    assert not Model.objects.exists() and not Alias.objects.exists()


def test_renaming_an_alias_on_change_to_another_models_name_is_refused(admin_client, llama):
    qwen = Model.objects.create(name="qwen-7b", source="org/qwen")
    alias = Alias.objects.create(model=qwen, name="qwen")
    before = snapshot()
    url = reverse("admin:catalog_model_change", args=[qwen.pk])
    response = admin_client.post(url, model_form("qwen-7b", alias_initial=[(alias.pk, "llama-70b")]))
    assert response.status_code == 200
    assert "is already the name of model “llama-70b”" in response.content.decode()
    assert snapshot() == before


def test_profile_engine_args_must_be_a_json_list_of_strings(admin_client):
    response = admin_client.post(ADD_URL, model_form("qwen-7b", profiles=[{"engine_args": '"--max-model-len 8192"'}]))
    assert response.status_code == 200
    assert "Engine args must be a JSON list of strings" in response.content.decode()
    assert not Model.objects.exists() and not Profile.objects.exists()


def test_profile_context_the_engine_would_refuse_is_a_form_error_naming_it(admin_client):
    response = admin_client.post(
        ADD_URL, model_form("qwen-7b", profiles=[{"engine_args": '["--max-model-len", "1.5K"]'}])
    )
    assert response.status_code == 200
    assert "Engine arg --max-model-len: &#x27;1.5K&#x27; is not a valid value" in response.content.decode()
    assert not Model.objects.exists() and not Profile.objects.exists()


def test_profile_with_max_below_min_replicas_is_a_form_error(admin_client):
    response = admin_client.post(ADD_URL, model_form("qwen-7b", profiles=[{"min_replicas": "3", "max_replicas": "2"}]))
    assert response.status_code == 200
    assert "Max replicas (2) is below min replicas (3)." in response.content.decode()
    assert not Model.objects.exists()


def test_multi_node_llamacpp_profile_is_a_form_error(admin_client):
    response = admin_client.post(
        ADD_URL, model_form("qwen-7b", profiles=[{"engine": "llamacpp", "nodes_per_replica": "2"}])
    )
    assert response.status_code == 200
    assert "llama.cpp replicas run on one node" in response.content.decode()
    assert not Model.objects.exists()
