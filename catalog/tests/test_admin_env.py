"""A profile's engine env in admin: edited as JSON, secret values never shown in plain text (change form, inline,
list, read-only view), and a form handed back as shown keeps them."""

import html
import json
import re

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission

from catalog.models import Model, Profile
from catalog.tests.test_admin import ADD_URL, model_form

pytestmark = pytest.mark.django_db

SECRET = "hf_admin_secret_9921"
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_TOKEN": SECRET}


@pytest.fixture
def profile():
    model = Model.objects.create(name="tiny", source="/models/tiny")
    return Profile.objects.create(model=model, engine="vllm", gpu_class="CPU", env=ENV)


def change_url(profile) -> str:
    return f"/admin/catalog/profile/{profile.pk}/change/"


def shown_env(page: str, name: str = "env") -> str:
    """The env textarea's text as the browser shows it (and would post it back)."""
    match = re.search(rf'<textarea name="{name}"[^>]*>(.*?)</textarea>', page, re.S)
    assert match, f"no {name} textarea"
    return html.unescape(match.group(1)).strip()


def hidden_initials(page: str) -> dict:
    """The hidden `initial-*` inputs a browser posts back (JSON fields with a default carry one)."""
    found = re.findall(r'<input type="hidden" name="(initial-[^"]+)" value="([^"]*)"', page)
    return {name: html.unescape(value) for name, value in found}


def profile_post(profile, env_text: str, page: str = "", **overrides) -> dict:
    data = {
        **hidden_initials(page),
        "model": str(profile.model_id),
        "order": "0",
        "engine": profile.engine,
        "gpu_class": profile.gpu_class,
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
        "env": env_text,
    }
    return data | overrides


def viewer():
    user = get_user_model().objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(
            codename__in=["view_profile", "view_model", "view_alias"], content_type__app_label="catalog"
        )
    )
    return user


def test_a_profile_with_env_is_added_through_the_model_form(admin_client):
    env = json.dumps(ENV)
    response = admin_client.post(ADD_URL, model_form("tiny", profiles=[{"env": env}]))
    assert response.status_code == 302
    assert Profile.objects.get(model__name="tiny").env == ENV


def test_the_change_form_masks_secrets_and_handing_it_back_keeps_them(admin_client, profile):
    page = admin_client.get(change_url(profile)).content.decode()
    assert SECRET not in page
    assert json.loads(shown_env(page)) == {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_TOKEN": "***"}

    shown = json.loads(shown_env(page))
    changed = json.dumps(shown | {"OMP_NUM_THREADS": "4"})
    response = admin_client.post(change_url(profile), profile_post(profile, changed, page))
    assert response.status_code == 302
    profile.refresh_from_db()
    assert profile.env == ENV | {"OMP_NUM_THREADS": "4"}


def test_a_form_handed_back_unchanged_is_no_change(admin_client, profile):
    page = admin_client.get(change_url(profile)).content.decode()
    assert SECRET not in str(hidden_initials(page))
    response = admin_client.post(change_url(profile), profile_post(profile, shown_env(page), page))
    assert response.status_code == 302
    profile.refresh_from_db()
    assert profile.env == ENV
    assert LogEntry.objects.get().get_change_message() == "No fields changed."


def test_a_new_secret_given_as_the_mask_is_refused_naming_it(admin_client, profile):
    response = admin_client.post(
        change_url(profile), profile_post(profile, '{"HF_TOKEN": "***", "WANDB_API_KEY": "***"}')
    )
    assert response.status_code == 200
    page = response.content.decode()
    assert "Variable WANDB_API_KEY: “***” stands for a value already stored" in html.unescape(page)
    assert SECRET not in page
    profile.refresh_from_db()
    assert profile.env == ENV


def test_a_form_redrawn_for_an_error_does_not_echo_a_typed_secret(admin_client, profile):
    typed = '{"HF_TOKEN": "hf_just_typed_5512", "9BAD": "x"}'
    response = admin_client.post(change_url(profile), profile_post(profile, typed))
    page = html.unescape(response.content.decode())
    assert "Variable name '9BAD' is not valid" in page
    assert "hf_just_typed_5512" not in page and SECRET not in page


def test_an_emptied_env_box_means_no_variables(admin_client, profile):
    response = admin_client.post(change_url(profile), profile_post(profile, ""))
    assert response.status_code == 302
    profile.refresh_from_db()
    assert profile.env == {}


def test_the_model_page_inline_and_the_profile_list_mask_secrets(admin_client, profile):
    page = admin_client.get(f"/admin/catalog/model/{profile.model_id}/change/").content.decode()
    assert SECRET not in page
    assert json.loads(shown_env(page, "profiles-0-env"))["HF_TOKEN"] == "***"
    listing = html.unescape(admin_client.get("/admin/catalog/profile/").content.decode())
    assert SECRET not in listing
    assert "HF_TOKEN='***' VLLM_CPU_KVCACHE_SPACE=1" in listing


def test_a_user_who_may_only_view_sees_the_env_masked(client, profile):
    client.force_login(viewer())
    for url in (change_url(profile), f"/admin/catalog/model/{profile.model_id}/change/"):
        response = client.get(url)
        assert response.status_code == 200, url
        page = html.unescape(response.content.decode())
        assert SECRET not in page, url
        assert "HF_TOKEN='***' VLLM_CPU_KVCACHE_SPACE=1" in page, url
