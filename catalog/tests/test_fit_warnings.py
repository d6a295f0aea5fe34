"""Edit time: the estimate per profile from the best source, warnings (not refusals) in `catalog apply`,
its dry run's verdicts, the REST answer and the admin; size fields validated and round-tripped."""

import json
import os
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command

from catalog.as_code import apply_catalog, dump_catalog, export_catalog
from catalog.catalog_file import CatalogFileError, load_catalog_text
from catalog.memory import Fit
from catalog.models import Model, Profile
from catalog.sizing import forget_sources, profile_memory, profile_verdict, verdict
from tests.fleet import make_node

pytestmark = pytest.mark.django_db

HUGE = """\
models:
- name: llama-70b
  source: meta-llama/Llama-3.1-70B-Instruct
  parameters_billions: 70.6
  dtype: bfloat16
  layers: 80
  kv_heads: 8
  head_dim: 128
  profiles:
  - {engine: vllm, gpu_class: L40S-48GB, gpus_per_node: 2, max_model_len: 8192}
  - {engine: vllm, gpu_class: H100-80GB, gpus_per_node: 2, max_model_len: 8192}
- name: unsized
  source: org/unsized
  profiles:
  - {engine: mock, gpu_class: A10-24GB}
"""


def run(*args) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("catalog", *args, stdout=out, stderr=err, no_color=True)
    return out.getvalue(), err.getvalue()


def test_apply_warns_of_a_profile_that_does_not_fit_and_applies_it_anyway(tmp_path):
    make_node("l40s", gpus=2, gpu_class="L40S-48GB")
    path = tmp_path / "catalog.yaml"
    path.write_text(HUGE)
    out, err = run("apply", str(path))
    assert Profile.objects.filter(model__name="llama-70b").count() == 2
    assert err.splitlines() == [
        "warning: llama-70b: profiles[0] L40S-48GB×2: does_not_fit: needs 69.5 GiB per GPU; L40S-48GB has 44.2 GiB "
        "usable (weights 65.8 + engine 2.5 + KV 1.2 for one 8192-token sequence); size from catalog: 70.6 B parameters "
        "in bfloat16 (placement will not put it there)"
    ]
    assert "memory" not in out


def test_dry_run_shows_each_profiles_verdict_including_unknown(tmp_path):
    path = tmp_path / "catalog.yaml"
    path.write_text(HUGE)
    out, _ = run("apply", str(path), "--dry-run")
    lines = [line for line in out.splitlines() if line.startswith("memory")]
    assert lines[0].startswith("memory       llama-70b: profiles[0] L40S-48GB×2: does_not_fit: needs 69.5 GiB")
    assert lines[1].startswith("memory       llama-70b: profiles[1] H100-80GB×2: fits: needs 69.5 GiB per GPU; ")
    assert lines[1].endswith("room for 4 full-length sequences; size from catalog: 70.6 B parameters in bfloat16")
    assert lines[2].startswith("memory       unsized: profiles[0] A10-24GB×1: unknown: size unknown (")
    assert out.splitlines()[-1].startswith("dry run, nothing changed")
    assert not Model.objects.exists()


def test_size_fields_round_trip_through_export_and_apply():
    apply_catalog(load_catalog_text(HUGE))
    exported = export_catalog()["models"]
    assert {k: exported[0][k] for k in ("parameters_billions", "dtype", "layers", "kv_heads", "head_dim")} == {
        "parameters_billions": 70.6,
        "dtype": "bfloat16",
        "layers": 80,
        "kv_heads": 8,
        "head_dim": 128,
    }
    assert exported[0]["profiles"][0]["max_model_len"] == 8192
    assert "dtype" not in exported[1]  # not given: not written
    plan = apply_catalog(load_catalog_text(dump_catalog(export_catalog())))
    assert plan.lines()[-1] == "0 created, 0 changed, 2 left alone, 0 deleted"


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"parameters_billions": 7}, 'models[0] "m": dtype: Give parameters (billions) and the weights dtype together'),
        ({"dtype": "fp16"}, 'models[0] "m": parameters_billions: Give parameters (billions) and the weights dtype'),
        ({"layers": 32, "kv_heads": 8}, 'models[0] "m": head_dim: Give layers, KV heads and head dim together'),
        ({"dtype": "fp4", "parameters_billions": 7}, "models[0] \"m\": dtype: Value 'fp4' is not a valid choice."),
        ({"parameters_billions": -1, "dtype": "fp8"}, 'models[0] "m": parameters_billions: Ensure this value is'),
    ],
)
def test_half_given_or_bad_size_fields_are_named(entry, problem):
    data = {"models": [{"name": "m", "source": "org/m", "profiles": [{"gpu_class": "A10-24GB"}], **entry}]}
    with pytest.raises(CatalogFileError) as caught:
        apply_catalog(data)
    assert any(message.startswith(problem) for message in caught.value.messages), caught.value.messages
    assert not Model.objects.exists()


def tiny_llama(folder, *, layers=2, hidden=64):
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 2048,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return config


def test_a_local_folder_is_read_once_per_modification_time(tmp_path):
    forget_sources()
    tiny_llama(tmp_path)
    model = Model.objects.create(name="tiny", source=str(tmp_path), parameters_billions=70, dtype="bfloat16")
    profile = Profile.objects.create(model=model, gpu_class="A10-24GB")
    first = profile_memory(profile)
    assert first.weights.source == "config"  # the folder's config.json beats the catalog's fields
    assert first.max_model_len == 2048 and first.kv is not None and first.kv.layers == 2

    stamp = os.stat(tmp_path / "config.json")
    tiny_llama(tmp_path, layers=4)
    os.utime(tmp_path / "config.json", ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    os.utime(tmp_path, ns=(os.stat(tmp_path).st_atime_ns, os.stat(tmp_path).st_mtime_ns))
    assert profile_memory(profile).kv.layers == 2  # same modification times: not read again

    os.utime(tmp_path / "config.json", ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000_000))
    assert profile_memory(profile).kv.layers == 4
    assert profile_memory(profile).weights.bytes > first.weights.bytes


def test_a_context_of_auto_keeps_the_other_engine_args_and_is_the_models_own(tmp_path):
    forget_sources()
    tiny_llama(tmp_path)  # max_position_embeddings 2048
    model = Model.objects.create(name="tiny", source=str(tmp_path))
    args = ["--max-model-len", "auto", "--gpu-memory-utilization", "0.5", "--kv-cache-dtype", "fp8"]
    profile = Profile.objects.create(model=model, gpu_class="A10-24GB", max_model_len=1024, engine_args=args)
    memory = profile_memory(profile)
    assert (memory.memory_fraction, memory.kv_dtype) == (0.5, "fp8")
    # The args' context wins over the profile's 1024 (it is not passed: with_context), and auto is the model's.
    assert memory.max_model_len == 2048


@pytest.mark.parametrize("kv_dtype", ["fp8_inc", "nvfp4", "turboquant_k8v4"])
def test_a_kv_cache_dtype_vllm_takes_keeps_the_other_engine_args(tmp_path, kv_dtype):
    forget_sources()
    tiny_llama(tmp_path)
    model = Model.objects.create(name="tiny", source=str(tmp_path))
    args = ["--gpu-memory-utilization", "0.5", "--kv-cache-dtype", kv_dtype, "--max-model-len", "1024"]
    profile = Profile.objects.create(model=model, gpu_class="A10-24GB", engine_args=args)
    memory = profile_memory(profile)
    assert (memory.memory_fraction, memory.kv_dtype, memory.max_model_len) == (0.5, kv_dtype, 1024)
    assert memory.unread_args == ()


def test_a_bad_engine_arg_leaves_the_others_read_and_the_verdict_names_it(tmp_path):
    forget_sources()
    tiny_llama(tmp_path)
    model = Model.objects.create(name="tiny", source=str(tmp_path))
    # Saved before edit-time checks knew the KV cache dtypes (objects.create does not validate).
    args = ["--gpu_memory_utilization", "0.5", "--kv-cache-dtype", "FP8", "--max-model-len", "1024"]
    profile = Profile.objects.create(model=model, gpu_class="A10-24GB", engine_args=args)
    memory = profile_memory(profile)
    assert (memory.memory_fraction, memory.kv_dtype, memory.max_model_len) == (0.5, None, 1024)
    assert [problem.split(" (")[0] for problem in memory.unread_args] == [
        "engine arg --kv-cache-dtype: 'FP8' is not a valid value"
    ]
    sentence = verdict(profile, "A10-24GB", 24 * 1024).sentence
    assert "engine arg --kv-cache-dtype: 'FP8' is not a valid value (vLLM takes auto" in sentence
    assert "counted as the engine's default" in sentence


@pytest.mark.parametrize(
    ("engine", "value", "takes"),
    [("vllm", "FP8", "vLLM takes auto, float16"), ("sglang", "fp8", "SGLang takes auto, bf16")],
)
def test_a_kv_cache_dtype_the_engine_would_refuse_is_refused_at_edit_time_naming_it(engine, value, takes):
    profile = {"gpu_class": "A10-24GB", "engine": engine, "engine_args": ["--kv-cache-dtype", value]}
    with pytest.raises(CatalogFileError) as caught:
        apply_catalog({"models": [{"name": "m", "source": "org/m", "profiles": [profile]}]})
    [message] = caught.value.messages
    assert message.startswith(
        f'models[0] "m": profiles[0].engine_args: Engine arg --kv-cache-dtype: {value!r} is not a valid value ({takes}'
    )
    assert not Model.objects.exists()


@pytest.mark.parametrize(
    ("engine", "args", "why"),
    [
        ("vllm", ["--max-model-len", "1.5K"], "vLLM allows no decimals with the binary suffix K: try 1.5k"),
        ("llamacpp", ["-c", "32k"], "llama.cpp takes a plain integer of tokens, and reads 32k as 32"),
    ],
)
def test_a_context_the_engine_would_refuse_is_refused_at_edit_time_naming_it(engine, args, why):
    profile = {"gpu_class": "A10-24GB", "engine": engine, "engine_args": args}
    with pytest.raises(CatalogFileError) as caught:
        apply_catalog({"models": [{"name": "m", "source": "org/m", "profiles": [profile]}]})
    assert caught.value.messages == [
        f'models[0] "m": profiles[0].engine_args: Engine arg {args[0]}: {args[1]!r} is not a valid value ({why}).'
    ]
    assert not Model.objects.exists()


def test_a_hub_source_uses_the_catalog_fields_and_unknown_says_so():
    model = Model.objects.create(name="m", source="org/m")
    profile = Profile.objects.create(model=model, gpu_class="A10-24GB")
    assert profile_verdict(profile, {}).fit is Fit.UNKNOWN
    assert profile_verdict(profile, {}).sentence.startswith("size unknown (")
    Model.objects.filter(pk=model.pk).update(parameters_billions=7.6, dtype="bfloat16")
    profile = Profile.objects.select_related("model").get(pk=profile.pk)
    judged = profile_verdict(profile, {"A10-24GB": 23028})
    assert judged.fit is Fit.FITS
    assert "KV cache not counted: its shape is unknown" in judged.sentence


def test_max_concurrency_is_passed_as_the_engines_batch_unless_its_args_set_it():
    from catalog.engine_flags import with_batch

    assert with_batch("vllm", ["--x"], 64) == ["--x", "--max-num-seqs", "64"]
    assert with_batch("sglang", [], 32) == ["--max-running-requests", "32"]
    assert with_batch("mock", [], 8) == ["--max-num-seqs", "8"]
    assert with_batch("vllm", ["--max_num_seqs=16"], 64) == ["--max_num_seqs=16"]  # theirs, in vLLM's spelling
    assert with_batch("llamacpp", [], 4) == []  # --parallel splits the context: the engine args' to set
    assert with_batch("vllm", [], None) == []


def test_max_model_len_is_passed_to_the_engine_unless_its_args_set_the_context():
    from catalog.engine_flags import with_context

    assert with_context("vllm", [], 8192) == ["--max-model-len", "8192"]
    assert with_context("sglang", ["--x"], 4096) == ["--x", "--context-length", "4096"]
    assert with_context("llamacpp", [], 4096) == ["--ctx-size", "4096"]
    assert with_context("llamacpp", ["-c", "2048"], 4096) == ["-c", "2048"]
    assert with_context("vllm", ["--max-model-len=1024"], 8192) == ["--max-model-len=1024"]
    assert with_context("mock", [], 8192) == []
    assert with_context("vllm", [], None) == []
    # SGLang's argparse takes no --context_length: it is not the context flag (and the engine refuses it).
    assert with_context("sglang", ["--context_length", "1"], 4096) == [
        "--context_length",
        "1",
        "--context-length",
        "4096",
    ]


@pytest.mark.parametrize(
    ("engine", "args"),
    [
        ("vllm", ["--max_model_len", "4096"]),  # vLLM's parser reads it as --max-model-len
        ("vllm", ["--max_model_len=4096"]),
        ("mock", ["--max_model_len", "4096"]),
        ("llamacpp", ["--ctx_size", "4096"]),  # llama.cpp's too, as --ctx-size
    ],
)
def test_a_context_set_in_another_spelling_of_the_flag_is_not_set_twice(engine, args):
    from catalog.engine_flags import sets_context, with_context

    assert with_context(engine, args, 8192) == args
    assert sets_context(engine, args)


def test_the_rest_answer_carries_warnings_and_the_admin_says_them(client):
    make_node("l40s", gpus=2, gpu_class="L40S-48GB")
    User.objects.create_superuser("admin", "a@example.com", "pw")
    client.login(username="admin", password="pw")
    entry = load_catalog_text(HUGE)["models"][0]
    answer = client.post("/api/v1/models/", entry, content_type="application/json")
    assert answer.status_code == 201, answer.content
    assert len(answer.json()["warnings"]) == 1
    assert answer.json()["warnings"][0].startswith("profiles[0] L40S-48GB×2: does_not_fit: needs 69.5 GiB per GPU")
    assert answer.json()["parameters_billions"] == 70.6

    page = client.get(f"/admin/catalog/model/{Model.objects.get().pk}/change/")
    assert "does_not_fit: needs 69.5 GiB per GPU; L40S-48GB has 44.2 GiB usable" in page.content.decode()


def test_saving_one_profile_in_admin_warns_with_its_models_name(client):
    make_node("a10", gpus=1, gpu_class="A10-24GB")
    User.objects.create_superuser("admin", "a@example.com", "pw")
    client.login(username="admin", password="pw")
    apply_catalog(load_catalog_text(HUGE))
    profile = Profile.objects.get(model__name="llama-70b", order=1)
    form = {
        "model": profile.model_id,
        "order": 1,
        "engine": "vllm",
        "gpu_class": "A10-24GB",
        "gpus_per_node": 1,
        "nodes_per_replica": 1,
        "min_replicas": 0,
        "max_replicas": 1,
        "target_concurrency": 8,
        "priority": 0,
        "pool": "default",
        "weight": 1,
        "max_model_len": 8192,
        "engine_args": "[]",
        "env": "{}",
    }
    answer = client.post(f"/admin/catalog/profile/{profile.pk}/change/", form, follow=True)
    said = [str(m) for m in answer.context["messages"]]
    assert any(m.startswith("Memory: llama-70b A10-24GB×1: does_not_fit: needs ") for m in said), said
    assert Profile.objects.get(pk=profile.pk).gpu_class == "A10-24GB"  # a warning, not a refusal


def test_the_model_change_page_shows_each_profiles_figures_per_gpu(client, django_assert_max_num_queries):
    make_node("l40s", gpus=2, gpu_class="L40S-48GB")
    make_node("h100", gpus=2, gpu_class="H100-80GB")
    User.objects.create_superuser("admin", "a@example.com", "pw")
    client.login(username="admin", password="pw")
    apply_catalog(load_catalog_text(HUGE))
    model = Model.objects.get(name="llama-70b")

    page = client.get(f"/admin/catalog/model/{model.pk}/change/").content.decode()

    assert (
        "verdict: <strong>does_not_fit</strong> · needs 69.5 GiB per GPU · 44.2 GiB usable per L40S-48GB GPU"
        " · full-length sequences that fit: 0" in page
    )
    assert "verdict: <strong>fits</strong> · needs 69.5 GiB per GPU · 73.6 GiB usable per H100-80GB GPU" in page
    # The fleet's GPU memory is read once for the page, whatever the number of profiles.
    Profile.objects.create(model=model, order=5, gpu_class="H100-80GB", gpus_per_node=2)
    with django_assert_max_num_queries(30) as queries:
        client.get(f"/admin/catalog/model/{model.pk}/change/")
    assert sum('MAX("inventory_gpu"."memory_mb")' in q["sql"] for q in queries.captured_queries) == 1
