"""LoRA adapters in the catalog: their rank, the profiles that take them, one namespace with models, the
catalog file and the admin."""

import json

import pytest
from django.core.exceptions import ValidationError

from catalog.as_code import Verdict, apply_catalog, dump_catalog, export_catalog
from catalog.catalog_file import CatalogFileError, load_catalog_text
from catalog.models import Adapter, Alias, Model, Profile, name_clash
from catalog.rules import rank_in_folder
from catalog.tests.test_admin import model_form

pytestmark = pytest.mark.django_db


def adapter_folder(path, rank):
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16}))
    return str(path)


@pytest.fixture
def llama():
    model = Model.objects.create(name="llama-8b", source="org/llama-8b")
    Alias.objects.create(model=model, name="llama")
    Profile.objects.create(model=model, gpu_class="H100-80GB", max_adapters=8, max_adapter_rank=32)
    return model


def errors_of(instance) -> dict:
    with pytest.raises(ValidationError) as raised:
        instance.full_clean()
    return raised.value.message_dict


@pytest.mark.django_db(False)
def test_the_rank_is_read_from_a_local_folders_adapter_config(tmp_path):
    assert rank_in_folder(adapter_folder(tmp_path / "sql-lora", 16)) == 16
    assert rank_in_folder("org/sql-lora") is None  # a hub id: unknown, not wrong
    assert rank_in_folder(str(tmp_path / "missing")) is None
    assert rank_in_folder("~nobody-by-this-name/sql") is None  # a home of no user here: unknown, not an error
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    assert rank_in_folder(str(broken)) is None
    assert rank_in_folder(adapter_folder(tmp_path / "rankless", "eight")) is None


def test_an_adapter_within_its_bases_max_rank_is_valid(llama, tmp_path):
    adapter = Adapter(name="sql", base=llama, source=adapter_folder(tmp_path / "sql", 32), aliases=["sql-bot"])
    adapter.full_clean()
    assert adapter.known_rank == 32


def test_a_rank_above_the_profiles_max_is_refused_naming_both(llama, tmp_path):
    assert errors_of(Adapter(name="sql", base=llama, source="org/sql", rank=64)) == {
        "rank": ["Rank 64 is above the max adapter rank 32 of model “llama-8b”'s profiles."]
    }
    # Read from the folder when the field is empty.
    read = Adapter(name="sql", base=llama, source=adapter_folder(tmp_path / "sql", 128))
    assert errors_of(read)["rank"] == ["Rank 128 is above the max adapter rank 32 of model “llama-8b”'s profiles."]


def test_a_base_without_a_profile_that_takes_adapters_is_refused_by_name():
    qwen = Model.objects.create(name="qwen-7b", source="org/qwen")
    Profile.objects.create(model=qwen, gpu_class="H100-80GB")
    assert errors_of(Adapter(name="sql", base=qwen, source="org/sql")) == {
        "base": ["Model “qwen-7b” has no profile that takes adapters; set max adapters on one of its profiles."]
    }


def test_adapter_names_and_aliases_share_the_namespace_of_models_and_aliases(llama):
    Adapter.objects.create(name="sql", base=llama, source="org/sql", aliases=["sql-bot"])
    assert errors_of(Adapter(name="llama", base=llama, source="org/x"))["name"] == [
        "“llama” is already an alias of model “llama-8b”"
    ]
    assert errors_of(Adapter(name="chat", base=llama, source="org/x", aliases=["sql-bot"]))["aliases"] == [
        "“sql-bot” is already an alias of adapter “sql”"
    ]
    assert errors_of(Adapter(name="chat", base=llama, source="org/x", aliases=["chat"]))["aliases"] == [
        "“chat” is this model's own name; an alias must differ from it"
    ]
    assert errors_of(Adapter(name="chat", base=llama, source="org/x", aliases=["bad name"]))["aliases"][0].startswith(
        "“bad name”: Use letters"
    )
    # And the other way round: a model or a model's alias may not take an adapter's name or alias.
    assert errors_of(Model(name="sql", source="org/sql"))["name"] == ["“sql” is already the name of adapter “sql”"]
    alias = Alias(model=llama, name="sql-bot")
    assert errors_of(alias)["name"] == ["“sql-bot” is already an alias of adapter “sql”"]
    assert name_clash("sql", adapters=False) is None


def test_profile_adapter_settings_are_refused_where_the_engine_cannot_honour_them(llama):
    def profile(**fields):
        return Profile(model=llama, gpu_class="H100-80GB", **fields)

    assert errors_of(profile(engine="llamacpp", max_adapters=4)) == {
        "max_adapters": ["llama.cpp cannot load adapters at run time; leave max adapters empty."]
    }
    assert errors_of(profile(engine="vllm", max_adapters=4, max_adapter_rank=12)) == {
        "max_adapter_rank": ["vLLM takes a max adapter rank of 1, 8, 16, 32, 64, 128, 256, 320, 512; 12 is not one."]
    }
    assert errors_of(profile(engine="sglang", max_adapter_rank=16)) == {
        "max_adapter_rank": ["A max adapter rank needs max adapters (the slots); set both or neither."]
    }
    profile(engine="sglang", max_adapters=4, max_adapter_rank=12).full_clean()


FILE = """\
models:
- name: llama-8b
  source: org/llama-8b
  profiles:
  - {engine: vllm, gpu_class: H100-80GB, max_adapters: 8, max_adapter_rank: 16}
  adapters:
  - {name: sql, source: org/sql, rank: 8, aliases: [sql-bot]}
  - {name: chat, source: org/chat}
"""


def test_the_catalog_file_creates_updates_and_deletes_adapters_by_name():
    first = apply_catalog(load_catalog_text(FILE))
    assert first.models[0].line() == "created      llama-8b: 1 profile; adapters sql, chat"
    sql = Adapter.objects.get(name="sql")
    assert (sql.base.name, sql.rank, sql.aliases, sql.enabled) == ("llama-8b", 8, ["sql-bot"], True)
    exported = export_catalog()
    assert exported["models"][0]["adapters"] == [
        {"name": "chat", "source": "org/chat", "enabled": True, "rank": None, "aliases": []},
        {"name": "sql", "source": "org/sql", "enabled": True, "rank": 8, "aliases": ["sql-bot"]},
    ]
    assert apply_catalog(load_catalog_text(dump_catalog(exported))).models[0].verdict == Verdict.LEFT_ALONE

    changed = FILE.replace("rank: 8, aliases: [sql-bot]", "rank: 16, aliases: []").replace(
        "  - {name: chat, source: org/chat}\n", "  - {name: summary, source: org/summary, enabled: false}\n"
    )
    dry = apply_catalog(load_catalog_text(changed), dry_run=True)
    assert dry.models[0].line() == "changed      llama-8b: adapters ~sql (rank, aliases) +summary -chat"
    assert set(Adapter.objects.values_list("name", flat=True)) == {"sql", "chat"}  # a dry run changes nothing
    apply_catalog(load_catalog_text(changed))
    assert sorted(Adapter.objects.values_list("name", "rank", "enabled")) == [
        ("sql", 16, True),
        ("summary", None, False),
    ]
    assert Adapter.objects.get(name="sql").pk == sql.pk  # updated in place


def test_the_catalog_file_names_every_adapter_problem():
    text = FILE.replace("rank: 8", "rank: 64").replace("name: chat", "name: llama-8b") + (
        "- name: qwen\n  source: org/qwen\n  profiles: [{gpu_class: H100-80GB}]\n"
        "  adapters: [{name: q-sql, source: org/q, aliases: [sql-bot], colour: red}]\n"
    )
    with pytest.raises(CatalogFileError) as raised:
        apply_catalog(load_catalog_text(text))
    assert raised.value.messages == [
        'models[0] "llama-8b": adapters[0].rank: Rank 64 is above the max adapter rank 16 of model “llama-8b”\'s '
        "profiles.",
        "models[1] \"qwen\": adapters[0]: unknown key 'colour' (expected one of name, source, enabled, rank, aliases, "
        "price_input_per_million, price_output_per_million)",
        'models[1] "qwen": adapters[0].base: Model “qwen” has no profile that takes adapters; set max adapters on one '
        "of its profiles.",
        'models[0] "llama-8b": adapters[1].name: “llama-8b” is already the name of model “llama-8b” '
        '(models[0] "llama-8b")',
        'models[1] "qwen": adapters[0].aliases[0]: “sql-bot” is already an alias of adapter “sql” '
        '(models[0] "llama-8b": adapters[0].aliases[0])',
    ]
    assert not Adapter.objects.exists()


def test_a_model_kept_out_of_the_file_keeps_its_adapters_names(llama):
    Adapter.objects.create(name="sql", base=llama, source="org/sql")
    text = "models:\n- name: sql\n  source: org/sql\n  profiles: [{gpu_class: H100-80GB}]\n"
    with pytest.raises(CatalogFileError) as raised:
        apply_catalog(load_catalog_text(text))
    assert raised.value.messages == ['models[0] "sql": name: “sql” is already the name of adapter “sql”']


def test_applying_adapters_reads_a_constant_number_of_queries(llama, django_assert_num_queries):
    Adapter.objects.bulk_create(Adapter(name=f"a{i}", base=llama, source=f"org/a{i}") for i in range(30))
    data = export_catalog()
    # Planning: models, aliases, adapters, profiles; plus the savepoint pair, whatever the adapters.
    with django_assert_num_queries(6):
        apply_catalog(data)
    for entry in data["models"][0]["adapters"]:
        entry["enabled"] = False
    # One UPDATE per changed adapter.
    with django_assert_num_queries(6 + 30):
        apply_catalog(data)


def test_the_admin_adds_adapters_inline_and_names_a_clash(admin_client, llama):
    url = f"/admin/catalog/model/{llama.pk}/change/"
    page = admin_client.get(url)
    assert 'name="adapters-TOTAL_FORMS"' in page.content.decode()
    data = model_form("llama-8b", alias_initial=[(llama.aliases.get().pk, "llama")], adapters=[{"name": "llama"}])
    # The existing profile row, unchanged.
    profile = llama.profiles.get()
    data.update({"profiles-TOTAL_FORMS": "1", "profiles-INITIAL_FORMS": "1", "profiles-0-id": str(profile.pk)})
    data.update({"profiles-0-model": str(llama.pk), "profiles-0-order": "0", "profiles-0-engine": "vllm"})
    data.update({"profiles-0-gpu_class": "H100-80GB", "profiles-0-gpus_per_node": "1", "profiles-0-weight": "1"})
    data.update({"profiles-0-nodes_per_replica": "1", "profiles-0-min_replicas": "0", "profiles-0-max_replicas": "1"})
    data.update({"profiles-0-target_concurrency": "8", "profiles-0-priority": "0", "profiles-0-pool": "default"})
    data.update({"profiles-0-max_adapters": "8", "profiles-0-max_adapter_rank": "32", "profiles-0-engine_args": "[]"})
    data.update({"profiles-0-env": "{}"})
    data.update({"adapters-0-source": "org/sql", "adapters-0-aliases": '["sql-bot"]'})
    response = admin_client.post(url, data)
    assert response.status_code == 200
    assert "“llama” is already an alias of model “llama-8b”" in response.content.decode()
    data["adapters-0-name"] = "sql"
    response = admin_client.post(url, data)
    assert response.status_code == 302, response.content.decode()[:2000]
    assert list(llama.adapters.values_list("name", "aliases")) == [("sql", ["sql-bot"])]


def test_a_profile_change_that_would_strand_the_models_adapters_is_refused(llama):
    Adapter.objects.create(name="sql", base=llama, source="org/sql", rank=32)
    profile = llama.profiles.get()
    profile.max_adapter_rank = 16
    assert errors_of(profile) == {"max_adapter_rank": ["Adapter “sql” has rank 32, above max adapter rank 16."]}
    profile.max_adapters = profile.max_adapter_rank = None
    assert errors_of(profile) == {
        "max_adapters": ["The model's adapters (“sql”) need a profile that takes adapters; keep max adapters."]
    }
    # Another profile taking adapters keeps them placeable.
    Profile.objects.create(model=llama, gpu_class="L40S-48GB", max_adapters=2)
    profile.full_clean()


def test_an_adapter_entry_of_the_wrong_shape_is_named_not_a_crash():
    text = FILE.replace("aliases: [sql-bot]", "aliases: [{a: 1}]").replace("{name: chat, source: org/chat}", "chat")
    with pytest.raises(CatalogFileError) as raised:
        apply_catalog(load_catalog_text(text))
    assert raised.value.messages == [
        'models[0] "llama-8b": adapters[0].aliases: Aliases must be a JSON list of names.',
        'models[0] "llama-8b": adapters[1]: expected a mapping with name, source, enabled, rank, aliases, '
        "price_input_per_million, price_output_per_million, got a string ('chat')",
    ]
