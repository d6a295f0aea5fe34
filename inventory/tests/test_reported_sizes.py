"""Header facts agents report: stored on the weights row, and the catalog's memory estimate for hub models."""

import asyncio
import json

import pytest
from django.utils import timezone

from agent.tests.test_weights_facts import hub_snapshot
from agent.weights.inventory import WeightsInventory
from catalog.memory import GIB
from catalog.models import Model, Profile
from catalog.sizing import fleet_memory, profile_memory, profile_verdict, verdict_lines
from inventory.models import Node, Weights
from inventory.services import record_weights
from nodewire.protocol import to_builtins
from nodewire.weights.messages import WeightsHeaderFacts, WeightsReport, WeightsShape
from tests.fleet import make_model

pytestmark = pytest.mark.django_db

L40S = "L40S-48GB"
# Llama 3.1 70B as its safetensors headers say (bf16 tensors) and its config.json's shape.
LLAMA_70B = WeightsHeaderFacts(
    format="safetensors",
    tensor_bytes=141_107_412_992,
    parameters=70_553_706_496,
    tensors=723,
    bytes_by_dtype={"BF16": 141_107_412_992},
    shape=WeightsShape(architecture="llama", layers=80, heads=64, kv_heads=8, embedding=8192, context_length=131072),
)


def report(source, header=None, size=150 * GIB) -> WeightsReport:
    path = f"/w/hub/models--{source.replace('/', '--')}"
    return WeightsReport(source=source, path=path, size_bytes=size, header=header)


def node(name="gpu-a") -> Node:
    return Node.objects.create(name=name)


def hub_model(name="llama-70b", **size) -> Model:
    """A hub model whose catalog fields (when given) say something else than its headers."""
    model = make_model(name, gpu_class=L40S, gpus_per_node=2, max_model_len=8192)
    Model.objects.filter(pk=model.pk).update(**size)
    model.refresh_from_db()
    return model


def test_a_header_report_is_stored_on_the_weights_row_and_rewritten_only_when_it_changes(django_assert_num_queries):
    gpu = node()
    now = timezone.now()
    record_weights(gpu.pk, [report("org/llama-70b", LLAMA_70B)], now)
    stored = Weights.objects.get().header
    assert stored["tensor_bytes"] == 141_107_412_992 and stored["shape"]["layers"] == 80
    with django_assert_num_queries(1):  # the same report again: one read, no write
        assert record_weights(gpu.pk, [report("org/llama-70b", LLAMA_70B)], now) == (0, 0, 0)
    smaller = WeightsHeaderFacts(format="gguf", tensor_bytes=10, parameters=20, tensors=1, bytes_by_dtype={"Q4_K": 10})
    with django_assert_num_queries(2):  # read, update: the header changed, the size and path did not
        assert record_weights(gpu.pk, [report("org/llama-70b", smaller)], now) == (0, 1, 0)
    assert Weights.objects.get().header == {
        "format": "gguf",
        "tensor_bytes": 10,
        "parameters": 20,
        "tensors": 1,
        "bytes_by_dtype": {"Q4_K": 10},
        "shape": None,
    }
    record_weights(gpu.pk, [report("org/llama-70b")], now)  # an older agent, or headers it could not read
    assert Weights.objects.get().header is None


def test_what_an_agent_scans_is_stored_with_the_exact_tensor_bytes(tmp_path):
    expected = hub_snapshot(tmp_path, "org/tiny")
    reports = asyncio.run(WeightsInventory(str(tmp_path)).scan_now())
    record_weights(node().pk, reports, timezone.now())
    header = Weights.objects.get(source="org/tiny").header
    assert header["tensor_bytes"] == expected and header["format"] == "safetensors"


def test_a_hub_model_is_sized_by_the_headers_a_node_reports_and_says_so():
    model = hub_model(parameters_billions=7.0, dtype="bfloat16")  # the catalog's guess: far too small
    record_weights(node().pk, [report(model.source, LLAMA_70B)], timezone.now())
    profile = model.profiles.get()

    memory = profile_memory(profile)
    assert (memory.weights.source, memory.weights.bytes) == ("reported", 141_107_412_992)
    assert memory.weights.detail == "safetensors headers as node gpu-a reports them"
    assert memory.kv is not None and memory.kv.layers == 80  # the KV shape from the reported config facts
    judged = profile_verdict(profile, fleet_memory())
    assert judged.fit == "does_not_fit" and judged.size_source == "reported"
    assert judged.sentence.startswith("needs 69.5 GiB per GPU; L40S-48GB has 44.2 GiB usable (weights 65.7 ")
    assert judged.sentence.endswith("; size from safetensors headers as node gpu-a reports them")


def test_without_a_report_the_catalog_fields_size_it_as_before():
    model = hub_model(parameters_billions=7.0, dtype="bfloat16")
    record_weights(node().pk, [report(model.source)], timezone.now())  # on disk, headers not reported
    memory = profile_memory(model.profiles.get())
    assert (memory.weights.source, memory.weights.bytes) == ("catalog", 14_000_000_000)


def test_a_local_folder_the_control_plane_reads_beats_any_report(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                    "intermediate_size": 128, "vocab_size": 100, "torch_dtype": "bfloat16"})
    )  # fmt: skip
    model = Model.objects.create(name="local", source=str(tmp_path))
    Profile.objects.create(model=model, gpu_class=L40S, gpus_per_node=1)
    # Were a node to report the same path, the folder the control plane reads itself still decides.
    row = {"source": str(tmp_path), "path": str(tmp_path), "size_bytes": 1, "header": to_builtins(LLAMA_70B)}
    Weights.objects.create(node=node(), seen_at=timezone.now(), **row)
    assert profile_memory(model.profiles.get()).weights.source == "config"


def test_the_newest_report_wins_when_nodes_disagree():
    model = hub_model()
    old, new = node("gpu-a"), node("gpu-b")
    earlier = timezone.now() - timezone.timedelta(minutes=5)
    stale = WeightsHeaderFacts(
        format="safetensors", tensor_bytes=8, parameters=4, tensors=1, bytes_by_dtype={"BF16": 8}
    )
    record_weights(old.pk, [report(model.source, stale)], earlier)
    record_weights(new.pk, [report(model.source, LLAMA_70B)], timezone.now())
    memory = profile_memory(model.profiles.get())
    assert memory.weights.bytes == LLAMA_70B.tensor_bytes and "node gpu-b" in memory.weights.detail


def test_float32_headers_count_half_under_vllm_and_the_context_comes_from_the_reported_shape():
    model = make_model("tiny", gpu_class=L40S)  # no max_model_len: the model's own context counts
    facts = WeightsHeaderFacts(
        format="safetensors",
        tensor_bytes=4_000_000,
        parameters=1_000_000,
        tensors=3,
        bytes_by_dtype={"F32": 4_000_000},
        shape=WeightsShape(architecture="llama", layers=2, heads=4, kv_heads=2, embedding=256, context_length=4096),
    )
    record_weights(node().pk, [report(model.source, facts)], timezone.now())
    memory = profile_memory(model.profiles.get())
    assert memory.weights.bytes == 2_000_000 and memory.weights.compute_dtype == "bfloat16"
    assert memory.max_model_len == 4096
    assert memory.kv.bytes_per_token(16) == 2 * 2 * 2 * 64 * 2  # K and V × layers × KV heads × head dim × 2 bytes


def test_a_stored_report_the_protocol_would_refuse_is_passed_over():
    model = hub_model(parameters_billions=7.0, dtype="bfloat16")
    Weights.objects.create(node=node(), source=model.source, path="/w/x", size_bytes=1, seen_at=timezone.now(),
                           header={"format": "safetensors", "tensor_bytes": "many"})  # fmt: skip
    assert profile_memory(model.profiles.get()).weights.source == "catalog"


def test_a_catalogs_verdicts_read_the_reports_once_however_many_hub_models(django_assert_num_queries):
    gpu = node()
    models = [hub_model(f"m{i}") for i in range(6)]
    record_weights(gpu.pk, [report(m.source, LLAMA_70B) for m in models], timezone.now())
    profiles = list(Profile.objects.select_related("model"))
    fleet = fleet_memory()
    with django_assert_num_queries(1):
        lines = verdict_lines(profiles, fleet)
    assert len(lines) == 6 and all(judged.size_source == "reported" for judged, _ in lines)
