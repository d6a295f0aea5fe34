"""Catalog as code: export then apply is a no-op, apply says what it did, all or nothing, prune and dry run."""

import pytest

from catalog.as_code import Verdict, apply_catalog, dump_catalog, export_catalog, plan_catalog
from catalog.catalog_file import CatalogFileError, load_catalog_text
from catalog.models import Alias, Model, Profile
from reconciler.models import Replica
from tests.fleet import make_replica

pytestmark = pytest.mark.django_db


def profile(**fields):
    return {"engine": "mock", "gpu_class": "H100-80GB", **fields}


def model(name, *, aliases=(), profiles=None, **fields):
    return {
        "name": name,
        "source": f"org/{name}",
        "aliases": list(aliases),
        "profiles": [profile()] if profiles is None else profiles,
        **fields,
    }


def catalog(*models):
    return {"models": list(models)}


def verdicts(plan):
    return {m.name: m.verdict for m in plan.models}


def snapshot():
    """Every catalog row with its id: what 'nothing changed' compares."""
    return (
        list(Model.objects.values_list("id", "name", "source", "enabled", "updated_at")),
        list(Alias.objects.values_list("id", "name", "model_id")),
        list(Profile.objects.values_list()),
    )


@pytest.fixture
def fleet_catalog():
    """A catalog made in the admin's way: two profiles with the admin's default order (both 0), aliases."""
    apply_catalog(
        catalog(
            model(
                "llama-70b",
                aliases=["llama", "l70"],
                profiles=[
                    profile(
                        gpus_per_node=8,
                        priority=10,
                        engine_args=["--max-model-len", "8192"],
                        env={"OMP_NUM_THREADS": "8", "HF_TOKEN": "hf_fleet_secret"},
                    ),
                    profile(gpu_class="L40S-48GB", gpus_per_node=4, idle_timeout_seconds=0),
                ],
            ),
            model("qwen-7b", aliases=["qwen"], enabled=False),
        )
    )
    Profile.objects.update(order=0)
    Profile.objects.filter(model__name="qwen-7b").update(start_seconds=12.5)


def test_export_then_apply_leaves_every_model_alone(fleet_catalog):
    before = snapshot()
    text = dump_catalog(export_catalog())
    plan = apply_catalog(load_catalog_text(text))
    assert verdicts(plan) == {"llama-70b": Verdict.LEFT_ALONE, "qwen-7b": Verdict.LEFT_ALONE}
    assert not any(plan.count(v) for v in (Verdict.CREATED, Verdict.CHANGED, Verdict.DELETED))
    assert snapshot() == before
    assert plan.lines()[-1] == "0 created, 0 changed, 2 left alone, 0 deleted"


def test_export_writes_the_profile_fields_in_list_order_and_nothing_learned(fleet_catalog):
    exported = export_catalog()["models"]
    assert [m["name"] for m in exported] == ["llama-70b", "qwen-7b"]
    llama = exported[0]
    assert llama["aliases"] == ["l70", "llama"]
    assert [p["gpu_class"] for p in llama["profiles"]] == ["H100-80GB", "L40S-48GB"]
    assert llama["profiles"][0] == {
        "engine": "mock",
        "gpu_class": "H100-80GB",
        "gpus_per_node": 8,
        "nodes_per_replica": 1,
        "min_replicas": 0,
        "max_replicas": 1,
        "target_concurrency": 8,
        "max_concurrency": None,
        "ttft_objective_seconds": None,
        "itl_objective_seconds": None,
        "priority": 10,
        "pool": "default",
        "weight": 1,
        "idle_timeout_seconds": None,
        "max_model_len": None,
        "prefetch_nodes": None,
        "sleep_level": None,
        "sleep_after_seconds": None,
        "max_adapters": None,
        "max_adapter_rank": None,
        "engine_args": ["--max-model-len", "8192"],
        "env": {"OMP_NUM_THREADS": "8", "HF_TOKEN": "***"},
    }
    assert "start_seconds" not in exported[1]["profiles"][0] and "order" not in exported[1]["profiles"][0]


def test_apply_is_idempotent_and_says_created_then_left_alone():
    data = catalog(model("qwen-7b", aliases=["qwen"]), model("bge-m3"))
    first = apply_catalog(data)
    assert [m.line() for m in first.models] == [
        "created      qwen-7b: aliases qwen; 1 profile",
        "created      bge-m3: 1 profile",
    ]
    before = snapshot()
    second = apply_catalog(data)
    assert verdicts(second) == {"qwen-7b": Verdict.LEFT_ALONE, "bge-m3": Verdict.LEFT_ALONE}
    assert snapshot() == before


def test_the_stream_continuation_switch_is_applied_and_exported_only_when_off():
    apply_catalog(catalog(model("qwen-7b", continue_streams=False)))
    assert Model.objects.get().continue_streams is False
    assert export_catalog()["models"][0]["continue_streams"] is False
    plan = apply_catalog(catalog(model("qwen-7b")))  # left out: on, as by default
    assert plan.models[0].line() == "changed      qwen-7b: continue_streams"
    assert Model.objects.get().continue_streams is True
    assert "continue_streams" not in export_catalog()["models"][0]


def test_a_change_names_the_fields_aliases_and_profiles_it_touches(fleet_catalog):
    data = export_catalog()
    llama = data["models"][0]
    llama["source"] = "org/llama-70b-v2"
    llama["aliases"] = ["llama", "llama-3"]
    llama["profiles"][1]["max_replicas"] = 3
    llama["profiles"][1]["target_concurrency"] = 4
    llama["profiles"].append(profile(gpu_class="A100-80GB", gpus_per_node=8))
    plan = apply_catalog(data)
    assert plan.models[0].line() == (
        "changed      llama-70b: source; aliases +llama-3 -l70; "
        "profiles[1] max_replicas, target_concurrency; profiles[2] added"
    )
    assert plan.models[1].verdict == Verdict.LEFT_ALONE
    llama_row = Model.objects.get(name="llama-70b")
    assert llama_row.source == "org/llama-70b-v2"
    assert sorted(llama_row.aliases.values_list("name", flat=True)) == ["llama", "llama-3"]
    assert [(p.gpu_class, p.max_replicas) for p in llama_row.profiles.all()] == [
        ("H100-80GB", 1),
        ("L40S-48GB", 3),
        ("A100-80GB", 1),
    ]


def test_profiles_are_matched_by_position_keeping_ids_learned_start_and_replicas(fleet_catalog):
    qwen = Model.objects.get(name="qwen-7b")
    row = qwen.profiles.get()
    replica = make_replica(row)
    data = export_catalog()
    data["models"][1]["profiles"][0]["gpu_class"] = "L40S-48GB"
    apply_catalog(data)
    row.refresh_from_db()
    assert row.gpu_class == "L40S-48GB" and row.start_seconds == 12.5
    assert Replica.objects.get().pk == replica.pk


def test_reordering_profiles_in_the_file_reorders_them_in_the_catalog(fleet_catalog):
    data = export_catalog()
    data["models"][0]["profiles"].reverse()
    apply_catalog(data)
    rows = Model.objects.get(name="llama-70b").profiles.all()
    assert [p.gpu_class for p in rows] == ["L40S-48GB", "H100-80GB"]
    assert [m["profiles"] for m in export_catalog()["models"]] == [m["profiles"] for m in data["models"]]


def test_profiles_beyond_the_files_list_are_deleted_and_their_replicas_counted(fleet_catalog):
    llama = Model.objects.get(name="llama-70b")
    second = list(llama.profiles.all())[1]
    make_replica(second)
    make_replica(second)
    data = export_catalog()
    data["models"][0]["profiles"] = data["models"][0]["profiles"][:1]
    plan = apply_catalog(data)
    assert plan.models[0].line() == "changed      llama-70b: profiles[1] deleted (2 replicas with it)"
    assert llama.profiles.count() == 1 and not Replica.objects.exists()


def test_a_new_profile_sorts_after_existing_ones_whatever_their_order_values(fleet_catalog):
    Profile.objects.filter(model__name="llama-70b").update(order=7)
    data = export_catalog()
    data["models"][0]["profiles"].append(profile(gpu_class="A100-80GB"))
    apply_catalog(data)
    assert [p["gpu_class"] for p in export_catalog()["models"][0]["profiles"]] == [
        "H100-80GB",
        "L40S-48GB",
        "A100-80GB",
    ]


def test_models_not_in_the_file_are_kept_and_listed_without_prune(fleet_catalog):
    before = snapshot()
    plan = apply_catalog(catalog(model("qwen-7b", aliases=["qwen"], enabled=False)), dry_run=True)
    assert plan.models[-1].line() == "not in file  llama-70b: kept; --prune deletes"
    plan = apply_catalog(export_catalog() | {"models": export_catalog()["models"][1:]})
    assert verdicts(plan) == {"qwen-7b": Verdict.LEFT_ALONE, "llama-70b": Verdict.NOT_IN_FILE}
    assert snapshot() == before
    assert "1 not in file (kept; --prune deletes)" in plan.lines()[-1]


def test_prune_deletes_models_not_in_the_file_and_says_what_went_with_them(fleet_catalog):
    llama = Model.objects.get(name="llama-70b")
    make_replica(llama.profiles.first())
    data = export_catalog()
    plan = apply_catalog({"models": data["models"][1:]}, prune=True)
    assert plan.models[-1].line() == "deleted      llama-70b: 2 profiles, 1 replica go with it"
    assert list(Model.objects.values_list("name", flat=True)) == ["qwen-7b"]
    assert not Alias.objects.filter(name__in=["llama", "l70"]).exists() and not Replica.objects.exists()


def test_prune_frees_the_names_of_deleted_models_for_the_file(fleet_catalog):
    plan = apply_catalog(catalog(model("llama", aliases=["llama-70b"])), prune=True)
    assert verdicts(plan) == {"llama": Verdict.CREATED, "llama-70b": Verdict.DELETED, "qwen-7b": Verdict.DELETED}
    assert list(Alias.objects.values_list("name", "model__name")) == [("llama-70b", "llama")]


def test_dry_run_prints_the_plan_and_changes_nothing(fleet_catalog):
    before = snapshot()
    data = export_catalog()
    data["models"][0]["enabled"] = False
    plan = apply_catalog(data | {"models": [*data["models"], model("new")]}, prune=True, dry_run=True)
    assert verdicts(plan) == {"llama-70b": Verdict.CHANGED, "qwen-7b": Verdict.LEFT_ALONE, "new": Verdict.CREATED}
    assert plan.lines()[-1] == "dry run, nothing changed: 1 created, 1 changed, 1 left alone, 0 deleted"
    assert snapshot() == before


def test_one_bad_model_changes_nothing_not_even_the_good_ones(fleet_catalog):
    before = snapshot()
    data = export_catalog()
    data["models"][0]["source"] = "org/changed"
    data["models"].append(model("good-new"))
    data["models"].append(model("bad-new", profiles=[profile(gpus_per_node=0)]))
    with pytest.raises(CatalogFileError) as caught:
        apply_catalog(data, prune=True)
    assert caught.value.messages == [
        'models[3] "bad-new": profiles[0].gpus_per_node: Ensure this value is greater than or equal to 1.'
    ]
    assert snapshot() == before


def test_an_alias_moves_between_listed_models_in_one_apply(fleet_catalog):
    data = export_catalog()
    data["models"][0]["aliases"] = ["l70"]
    data["models"][1]["aliases"] = ["qwen", "llama"]
    apply_catalog(data)
    assert Alias.objects.get(name="llama").model.name == "qwen-7b"


def test_a_name_an_unlisted_model_keeps_is_a_clash(fleet_catalog):
    with pytest.raises(CatalogFileError) as caught:
        apply_catalog(catalog(model("qwen-7b", aliases=["llama"], enabled=False)))
    assert caught.value.messages == [
        'models[0] "qwen-7b": aliases[0]: “llama” is already an alias of model “llama-70b”'
    ]
    with pytest.raises(CatalogFileError) as caught:
        apply_catalog(catalog(model("l70")))
    assert caught.value.messages == ['models[0] "l70": name: “l70” is already an alias of model “llama-70b”']


def test_apply_reads_a_constant_number_of_queries_and_writes_a_few_per_row(fleet_catalog, django_assert_num_queries):
    data = export_catalog()
    # Planning: models, their aliases, adapters and profiles (with replica counts); plus the savepoint pair.
    with django_assert_num_queries(6):
        apply_catalog(data)
    for i in range(20):
        data["models"].append(model(f"m{i}", aliases=[f"alias-{i}"], profiles=[profile(), profile(gpus_per_node=2)]))
    with django_assert_num_queries(4):
        plan_catalog(data)  # no transaction of its own: the four reads, and the name checks in memory
    # Each new model: its row, one alias, two profiles.
    with django_assert_num_queries(6 + 20 * 4):
        apply_catalog(data)
    # Changing every field of a profile is still one UPDATE.
    for m in data["models"][2:]:
        m["profiles"][0] |= {"gpus_per_node": 4, "priority": 3, "pool": "p", "weight": 2, "engine_args": ["--x"]}
    with django_assert_num_queries(6 + 20):
        apply_catalog(data)
