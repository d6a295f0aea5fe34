"""A bad catalog file is refused with every problem named (model, field, problem) and nothing changed."""

import pytest

from catalog.as_code import apply_catalog
from catalog.catalog_file import CatalogFileError, load_catalog_text
from catalog.models import Alias, Model, Profile

pytestmark = pytest.mark.django_db

GOOD_MODEL = """\
- name: llama-70b
  source: meta/llama
  aliases: [llama]
  profiles:
  - {gpu_class: H100-80GB, gpus_per_node: 8}
"""


def problems(text, **options):
    """The messages applying `text` is refused with; asserts that the catalog did not change."""
    before = (list(Model.objects.values_list()), list(Alias.objects.values_list()), list(Profile.objects.values_list()))
    with pytest.raises(CatalogFileError) as caught:
        apply_catalog(load_catalog_text(text), **options)
    after = (list(Model.objects.values_list()), list(Alias.objects.values_list()), list(Profile.objects.values_list()))
    assert after == before
    return caught.value.messages


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "the file is empty; expected a mapping with a `models:` list"),
        ("# only a comment\n", "the file is empty; expected a mapping with a `models:` list"),
        ("- name: x\n", "the top level must be a mapping with a `models:` list, not a list"),
        ("just words", "the top level must be a mapping with a `models:` list, not a string ('just words')"),
        ("model: []\n", "unknown top-level key 'model' (expected only `models:`)"),
        ("{}\n", "the top level has no `models:` list"),
        ("models:\n", "models: expected a list of models, got nothing (null)"),
        ("models: qwen\n", "models: expected a list of models, got a string ('qwen')"),
        (
            "models: [qwen]\n",
            "models[0]: expected a mapping with name, source, enabled, continue_streams, parameters_billions, dtype, layers, kv_heads, head_dim, price_input_per_million, price_output_per_million, aliases, profiles, adapters, got a string ('qwen')",
        ),
    ],
)
def test_a_file_of_the_wrong_shape_is_named(text, message):
    assert message in problems(text)


def test_a_file_that_is_not_yaml_says_where():
    [message] = problems("models:\n  - name: [unclosed\n")
    assert message.startswith("the file is not valid YAML: ")
    assert "line 3" in message


def test_unknown_and_missing_keys_are_named_with_the_model_and_field():
    text = """\
models:
- name: qwen
  sorce: org/qwen
  profiles:
  - {gpu_class: L40S-48GB, order: 1, start_seconds: 3.5, gpus: 2}
  - {gpus_per_node: 1}
- source: org/nameless
  profiles: []
"""
    assert problems(text) == [
        "models[0] \"qwen\": unknown key 'sorce' (expected one of name, source, enabled, continue_streams, parameters_billions, dtype, layers, kv_heads, head_dim, price_input_per_million, price_output_per_million, aliases, profiles, adapters)",
        'models[0] "qwen": source: missing (required)',
        "models[0] \"qwen\": profiles[0]: unknown key 'order' (a profile's order is its position in the list)",
        "models[0] \"qwen\": profiles[0]: unknown key 'start_seconds' (the start time is learned, not set)",
        "models[0] \"qwen\": profiles[0]: unknown key 'gpus' (expected one of engine, gpu_class, gpus_per_node, "
        "nodes_per_replica, min_replicas, max_replicas, target_concurrency, max_concurrency, ttft_objective_seconds, "
        "itl_objective_seconds, priority, pool, weight, "
        "idle_timeout_seconds, max_model_len, prefetch_nodes, sleep_level, sleep_after_seconds, max_adapters, max_adapter_rank, engine_args, env)",
        'models[0] "qwen": profiles[1].gpu_class: missing (required)',
        "models[1]: name: missing (required)",
    ]


def test_wrong_types_are_named_not_converted():
    text = """\
models:
- name: qwen
  source: org/qwen
  enabled: "yes"
  aliases: x
  profiles:
  - {gpu_class: L40S-48GB, gpus_per_node: "two", max_replicas: true, priority: 1.5, pool: 7}
- name: bge
  source: org/bge
  aliases: [3]
  profiles: {gpu_class: L40S-48GB}
"""
    assert problems(text) == [
        "models[0] \"qwen\": enabled: expected true or false, got a string ('yes')",
        "models[0] \"qwen\": aliases: expected a list of names, got a string ('x')",
        "models[0] \"qwen\": profiles[0].gpus_per_node: expected an integer, got a string ('two')",
        'models[0] "qwen": profiles[0].max_replicas: expected an integer, got true (true/false)',
        'models[0] "qwen": profiles[0].priority: expected an integer, got a number (1.5)',
        'models[0] "qwen": profiles[0].pool: expected a string, got a number (7)',
        'models[1] "bge": aliases[0]: expected a name (a string), got a number (3)',
        'models[1] "bge": profiles: expected a list of profiles, got a mapping',
    ]


def test_the_models_own_validation_names_the_model_and_field():
    """The same field validators and clean() the admin runs, every problem at once."""
    text = """\
models:
- name: ok-model
  source: org/ok
  profiles: [{gpu_class: H100-80GB}]
- name: qwen
  source: org/qwen
  profiles:
  - {gpu_class: L40S-48GB, gpus_per_node: 0}
  - {gpu_class: "bad class", engine: llamacpp, nodes_per_replica: 2, min_replicas: 3, max_replicas: 2}
  - {gpu_class: H100-80GB, engine: tgi, engine_args: "--max-model-len 8192", idle_timeout_seconds: -1}
- name: "no spaces allowed"
  source: ""
  aliases: ["-dash-first"]
  profiles: []
"""
    assert problems(text) == [
        'models[1] "qwen": profiles[0].gpus_per_node: Ensure this value is greater than or equal to 1.',
        'models[1] "qwen": profiles[1].gpu_class: Use letters, digits and . _ - (e.g. H100-80GB).',
        'models[1] "qwen": profiles[1].max_replicas: Max replicas (2) is below min replicas (3).',
        'models[1] "qwen": profiles[1].nodes_per_replica: llama.cpp replicas run on one node; set nodes per replica to 1.',
        "models[1] \"qwen\": profiles[2].engine: Value 'tgi' is not a valid choice.",
        'models[1] "qwen": profiles[2].idle_timeout_seconds: Ensure this value is greater than or equal to 0.',
        'models[1] "qwen": profiles[2].engine_args: Engine args must be a JSON list of strings (an argv), '
        "not a shell string.",
        'models[2] "no spaces allowed": name: Use letters, digits and . _ : / - (starting with a letter or digit).',
        'models[2] "no spaces allowed": source: This field cannot be blank.',
        'models[2] "no spaces allowed": aliases[0]: Use letters, digits and . _ : / - (starting with a letter or digit).',
    ]


def test_names_clash_inside_the_file():
    text = f"""\
models:
{GOOD_MODEL}- name: qwen
  source: org/qwen
  aliases: [qwen, llama, q, q]
  profiles: []
- name: llama-70b
  source: org/again
  profiles: []
- name: q
  source: org/q
  profiles: []
"""
    assert problems(text) == [
        'models[1] "qwen": aliases[0]: “qwen” is this model\'s own name; an alias must differ from it',
        'models[1] "qwen": aliases[1]: “llama” is already an alias of model “llama-70b” (models[0] "llama-70b": aliases[0])',
        'models[1] "qwen": aliases[3]: “q” is already an alias of model “qwen” (models[1] "qwen": aliases[2])',
        'models[2] "llama-70b": name: “llama-70b” is already the name of model “llama-70b” (models[0] "llama-70b")',
        'models[3] "q": name: “q” is already an alias of model “qwen” (models[1] "qwen": aliases[2])',
    ]


def test_all_problems_of_all_kinds_are_reported_together():
    Model.objects.create(name="kept", source="org/kept")
    text = """\
models:
- name: a
  source: org/a
  extra: 1
  profiles: []
- name: kept-too
  source: org/k
  aliases: [kept]
  profiles: [{gpu_class: H100-80GB, weight: 0}]
"""
    assert problems(text) == [
        "models[0] \"a\": unknown key 'extra' (expected one of name, source, enabled, continue_streams, parameters_billions, dtype, layers, kv_heads, head_dim, price_input_per_million, price_output_per_million, aliases, profiles, adapters)",
        'models[1] "kept-too": profiles[0].weight: Ensure this value is greater than or equal to 1.',
        'models[1] "kept-too": aliases[0]: “kept” is already the name of model “kept”',
    ]
