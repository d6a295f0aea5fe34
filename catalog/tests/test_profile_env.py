"""A profile's engine env: validated like the agent validates it, secrets masked in `catalog export`, and the
mask handed back by `catalog apply` keeps the stored value, so export then apply is exact."""

from io import StringIO

import pytest
from django.core.exceptions import ValidationError
from django.core.management import call_command

from catalog.as_code import Verdict, apply_catalog, export_catalog
from catalog.catalog_file import CatalogFileError, load_catalog_text
from catalog.models import Model, Profile
from catalog.rules import engine_env_problem, keep_stored_secrets

pytestmark = pytest.mark.django_db

TOKEN = "hf_stored_secret_4410"
CATALOG = f"""\
models:
- name: tiny-llama
  source: /models/tiny-llama
  profiles:
  - engine: vllm
    gpu_class: CPU
    engine_args: [--dtype, float32]
    env: {{VLLM_CPU_KVCACHE_SPACE: "1", HF_TOKEN: "{TOKEN}"}}
  - {{engine: vllm, gpu_class: L40S-48GB}}
"""


def run(*args) -> str:
    out = StringIO()
    call_command("catalog", *args, stdout=out, stderr=StringIO(), no_color=True)
    return out.getvalue()


def profile_row(**fields) -> Profile:
    model = Model.objects.create(name="m", source="org/m")
    return Profile(model=model, gpu_class="H100-80GB", **fields)


def stored_envs() -> list[dict]:
    return list(Profile.objects.order_by("model__name", "order", "id").values_list("env", flat=True))


@pytest.mark.parametrize("env", [{}, {"OMP_NUM_THREADS": "8"}, {"HF_TOKEN": "hf_x", "_EMPTY": ""}])
def test_a_profile_with_a_valid_env_is_clean(env):
    profile_row(env=env).full_clean()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"9LIVES": "1"}, "Variable name '9LIVES' is not valid"),
        ({"VLLM_CPU_KVCACHE_SPACE": 1}, "Variable VLLM_CPU_KVCACHE_SPACE: the value must be a string, not a number"),
        ({"A": "x\x00"}, "Variable A: the value holds a NUL character"),
        ({"CUDA_VISIBLE_DEVICES": "0"}, "Variable CUDA_VISIBLE_DEVICES cannot be set on a profile"),
        (["A=1"], "Engine env must be a mapping of variable names to strings"),
    ],
)
def test_a_bad_env_is_a_validation_error_on_the_env_field_naming_the_variable(env, message):
    with pytest.raises(ValidationError) as caught:
        profile_row(env=env).full_clean()
    assert [m for m in caught.value.message_dict["env"] if message in m], caught.value.message_dict
    assert engine_env_problem(env) is not None


def test_the_mask_keeps_the_stored_value_and_a_new_secret_must_be_given():
    stored = {"HF_TOKEN": TOKEN, "A": "1"}
    assert keep_stored_secrets({"HF_TOKEN": "***", "A": "2"}, stored) == ({"HF_TOKEN": TOKEN, "A": "2"}, None)
    assert keep_stored_secrets({"HF_TOKEN": "hf_new"}, stored) == ({"HF_TOKEN": "hf_new"}, None)
    # A name that is not secret is never masked, so its "***" is a value like any other.
    assert keep_stored_secrets({"A": "***"}, stored) == ({"A": "***"}, None)
    env, problem = keep_stored_secrets({"OPENAI_API_KEY": "***"}, stored)
    assert problem == (
        "Variable OPENAI_API_KEY: “***” stands for a value already stored, and no profile of this model has one; "
        "give the value."
    )


def test_the_mask_takes_the_value_the_models_profiles_agree_on_else_its_own():
    mine, sibling = {"HF_TOKEN": "a"}, {"HF_TOKEN": "b"}
    assert keep_stored_secrets({"HF_TOKEN": "***"}, {}, [{"HF_TOKEN": "a"}, {}]) == ({"HF_TOKEN": "a"}, None)
    assert keep_stored_secrets({"HF_TOKEN": "***"}, mine, [sibling]) == ({"HF_TOKEN": "a"}, None)
    _, problem = keep_stored_secrets({"HF_TOKEN": "***"}, {}, [mine, sibling])
    assert problem is not None and "this model's profiles hold different ones" in problem


def test_yaml_env_applies_exports_masked_and_applies_back_exactly(tmp_path):
    run("apply", str(_write(tmp_path / "in.yaml", CATALOG)))
    first, second = Profile.objects.order_by("order", "id")
    assert first.env == {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_TOKEN": TOKEN} and second.env == {}

    exported = run("export")
    assert TOKEN not in exported
    assert "env: {HF_TOKEN: '***', VLLM_CPU_KVCACHE_SPACE: '1'}" in exported
    before = list(Profile.objects.values_list())
    assert run("apply", str(_write(tmp_path / "out.yaml", exported))).splitlines()[0] == "left alone   tiny-llama"
    assert list(Profile.objects.values_list()) == before
    assert run("export") == exported


def test_reordered_profiles_keep_their_secrets_through_the_mask():
    apply_catalog(load_catalog_text(CATALOG))
    data = export_catalog()
    data["models"][0]["profiles"].reverse()
    apply_catalog(data)
    assert stored_envs() == [{}, {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_TOKEN": TOKEN}]


def test_a_changed_secret_is_applied_and_named_in_the_plan_without_its_value():
    apply_catalog(load_catalog_text(CATALOG))
    data = export_catalog()
    data["models"][0]["profiles"][0]["env"]["HF_TOKEN"] = "hf_rotated"
    plan = apply_catalog(data)
    assert (
        plan.models[0].verdict == Verdict.CHANGED
        and plan.models[0].line() == "changed      tiny-llama: profiles[0] env"
    )
    assert stored_envs()[0]["HF_TOKEN"] == "hf_rotated"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ("{OPENAI_API_KEY: '***'}", 'models[0] "tiny-llama": profiles[1].env: Variable OPENAI_API_KEY: “***” stands'),
        ("{VLLM_CPU_KVCACHE_SPACE: 1}", "profiles[1].env: Variable VLLM_CPU_KVCACHE_SPACE: the value must be a string"),
        ("{HF_HOME: /data}", "profiles[1].env: Variable HF_HOME cannot be set on a profile"),
        ("[A=1]", "profiles[1].env: Engine env must be a mapping of variable names to strings"),
    ],
)
def test_a_bad_env_in_a_file_is_named_and_changes_nothing(env, message):
    apply_catalog(load_catalog_text(CATALOG))
    before = stored_envs()
    # With a change to the first profile that must not be applied either (all or nothing).
    text = CATALOG.replace(
        "{engine: vllm, gpu_class: L40S-48GB}", f"{{engine: vllm, gpu_class: L40S-48GB, env: {env}}}"
    )
    text = text.replace(f'HF_TOKEN: "{TOKEN}"', 'HF_TOKEN: "hf_other"')
    with pytest.raises(CatalogFileError) as caught:
        apply_catalog(load_catalog_text(text))
    assert [m for m in caught.value.messages if message in m], caught.value.messages
    assert stored_envs() == before


def _write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path
