"""Profile numbers are range-checked like the database columns on every path (admin and full_clean,
SQLite included), fields carry human labels, the add page offers one profile row, GPU classes are
suggested from what nodes report with a warning for one no node has, and engine args errors name
what was given."""

import pytest
from django.core.exceptions import ValidationError

from catalog.admin import unknown_gpu_classes
from catalog.models import Model, Profile
from catalog.rules import engine_args_problem
from catalog.tests.test_admin import ADD_URL, model_form, snapshot
from tests.fleet import make_node

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("priority", "99999999", "less than or equal to 32767"),
        ("priority", "-40000", "greater than or equal to -32768"),
        ("weight", "70000", "less than or equal to 32767"),
        ("weight", "0", "greater than or equal to 1"),
        ("order", "40000", "less than or equal to 32767"),
        ("nodes_per_replica", "40000", "less than or equal to 32767"),
        ("max_replicas", "40000", "less than or equal to 32767"),
        ("target_concurrency", "0", "greater than or equal to 1"),
        ("idle_timeout_seconds", "3000000000", "less than or equal to 2147483647"),
    ],
)
def test_out_of_range_numbers_are_refused_in_admin_and_nothing_saved(admin_client, field, value, message):
    response = admin_client.post(ADD_URL, model_form("qwen-7b", profiles=[{field: value}]))
    assert response.status_code == 200
    assert message in response.content.decode()
    assert snapshot() == ([], [], 0)


@pytest.mark.parametrize(
    "field, value",
    [("priority", 99999999), ("priority", -32769), ("weight", 70000), ("min_replicas", 32768), ("order", 32768)],
)
def test_out_of_range_numbers_fail_full_clean(field, value):
    model = Model.objects.create(name="qwen-7b", source="org/q")
    profile = Profile(model=model, gpu_class="H100-80GB", max_replicas=32767, **{field: value})
    with pytest.raises(ValidationError) as caught:
        profile.full_clean()
    assert "or equal to" in caught.value.message_dict[field][0]


def test_the_edges_of_each_range_are_accepted():
    model = Model.objects.create(name="qwen-7b", source="org/q")
    Profile(model=model, gpu_class="H100-80GB", priority=-32768, weight=32767, max_replicas=32767).full_clean()
    Profile(model=model, gpu_class="H100-80GB", priority=32767, idle_timeout_seconds=2147483647).full_clean()


def test_fields_have_human_labels(admin_client):
    labels = {f.name: f.verbose_name for f in Profile._meta.get_fields() if hasattr(f, "verbose_name")}
    assert labels["gpu_class"] == "GPU class"
    assert labels["gpus_per_node"] == "GPUs per node"
    assert labels["nodes_per_replica"] == "nodes per replica"
    assert labels["min_replicas"] == "min replicas"
    page = admin_client.get(ADD_URL).content.decode()
    assert "GPU class" in page and "GPUs per node" in page and "Gpu class" not in page


def test_the_add_page_offers_one_empty_profile_row_and_the_change_page_none(admin_client):
    page = admin_client.get(ADD_URL).content.decode()
    assert 'name="profiles-TOTAL_FORMS" value="1"' in page
    model = Model.objects.create(name="qwen-7b", source="org/q")
    Profile.objects.create(model=model, gpu_class="H100-80GB")
    page = admin_client.get(f"/admin/catalog/model/{model.pk}/change/").content.decode()
    assert 'name="profiles-TOTAL_FORMS" value="1"' in page  # the existing profile, no empty one


def test_an_untouched_empty_profile_row_is_not_saved(admin_client):
    data = model_form("qwen-7b", profiles=[{"gpu_class": "", "engine_args": ""}])
    response = admin_client.post(ADD_URL, data)
    assert response.status_code == 302
    assert Model.objects.filter(name="qwen-7b").exists() and not Profile.objects.exists()


def test_gpu_classes_nodes_report_are_offered(admin_client):
    make_node("gpu-a", gpu_class="H100-80GB")
    make_node("gpu-b", gpu_class="L40S-48GB")
    page = admin_client.get(ADD_URL).content.decode()
    assert 'list="id_profiles-0-gpu_class_classes"' in page
    assert (
        '<datalist id="id_profiles-0-gpu_class_classes"><option value="H100-80GB"><option value="L40S-48GB">'
        "</datalist>" in page
    )


def test_a_gpu_class_no_node_has_is_saved_with_a_warning(admin_client):
    make_node("gpu-a", gpu_class="H100-80GB")
    response = admin_client.post(ADD_URL, model_form("qwen-7b", profiles=[{"gpu_class": "H100"}]), follow=True)
    assert Profile.objects.get().gpu_class == "H100"
    page = response.content.decode()
    assert "No node reports GPU class “H100” (known: H100-80GB)" in page
    assert "Check the spelling" in page


def test_a_gpu_class_a_node_has_gives_no_warning(admin_client):
    make_node("gpu-a", gpu_class="H100-80GB")
    response = admin_client.post(ADD_URL, model_form("qwen-7b", profiles=[{"gpu_class": "H100-80GB"}]), follow=True)
    assert "No node reports" not in response.content.decode()
    assert unknown_gpu_classes(Profile.objects.all()) == []


def test_the_profile_change_page_warns_too(admin_client):
    model = Model.objects.create(name="qwen-7b", source="org/q")
    profile = Profile.objects.create(model=model, gpu_class="H100-80GB")
    data = {
        "model": str(model.pk),
        "order": "0",
        "engine": "vllm",
        "gpu_class": "A100-40GB",
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
    }
    response = admin_client.post(f"/admin/catalog/profile/{profile.pk}/change/", data, follow=True)
    assert "No node reports GPU class “A100-40GB” (known: none yet)" in response.content.decode()


@pytest.mark.parametrize(
    "given, what",
    [
        ('{"max-model-len": 8192}', "not an object."),
        ('"--max-model-len 8192"', "not a shell string."),
        ("8192", "not a number."),
        ('["--max-model-len", 8192]', "item 1 is not a string."),
    ],
)
def test_engine_args_errors_name_what_was_given(admin_client, given, what):
    response = admin_client.post(ADD_URL, model_form("qwen-7b", profiles=[{"engine_args": given}]))
    page = response.content.decode()
    assert (
        f"Engine args must be a JSON list of strings (an argv){', ' if what.startswith('not') else '; '}{what}" in page
    )
    assert "shell string" not in page or "shell" in what
    assert snapshot() == ([], [], 0)


def test_engine_args_problem_accepts_an_argv():
    assert engine_args_problem(["--max-model-len", "8192"]) is None
    assert engine_args_problem({}) == "Engine args must be a JSON list of strings (an argv), not an object."
