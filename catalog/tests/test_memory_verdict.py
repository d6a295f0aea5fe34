"""KV cache per token and the per-GPU verdict: the rule of catalog/memory.py on known models and at its edges."""

import re

import numpy as np
import pytest

from catalog.engine_flags import MemoryArgs, kv_cache_bits, memory_args, parallel_shape, refused_value
from catalog.kv_cache import KVShape, kv_shape_from_config, kv_shape_from_header
from catalog.memory import (
    ENGINE_MEMORY,
    GIB,
    MIB,
    VLLM_MEMORY_FRACTION,
    Fit,
    GPUMemory,
    ProfileMemory,
    WeightsEstimate,
    estimate_weights,
    judge,
    served_context,
    window_slack_tokens,
)
from catalog.parameters import dtype_bits
from catalog.tests.test_memory_parameters import (
    DEEPSEEK_V2_LITE,
    GEMMA_2_9B,
    LLAMA_3_1_8B,
    MISTRAL_7B,
    QWEN_2_5_7B,
    dense,
)
from nodewire.tests.test_weights_headers import random_tensors, write_safetensors
from nodewire.weights.header_types import HeaderShape
from nodewire.weights.headers import read_weights_headers
from tests.tiny_gguf import write_tiny_llama

LLAMA_3_1_70B = dense("llama", 8192, 28672, 80, 64, 8, 128256, tie_word_embeddings=False, torch_dtype="bfloat16")
H100 = GPUMemory("H100-80GB", 81559 * MIB)  # what NVML reports for an H100 SXM 80GB
L40S = GPUMemory("L40S-48GB", 46068 * MIB)


@pytest.mark.parametrize(
    ("config", "per_token"),
    [
        (LLAMA_3_1_8B, 2 * 32 * 8 * 128 * 2),  # 128 KiB: the figure vLLM's docs give for Llama 3 8B
        (LLAMA_3_1_70B, 2 * 80 * 8 * 128 * 2),  # 320 KiB
        (QWEN_2_5_7B, 2 * 28 * 4 * 128 * 2),  # 4 KV heads: 56 KiB
        (GEMMA_2_9B, 2 * 42 * 8 * 256 * 2),  # head_dim 256 from the config, not 3584 / 16
        (DEEPSEEK_V2_LITE, (512 + 64) * 27 * 2),  # MLA: one latent per layer, not K and V per head
    ],
    ids=["llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "gemma-2-9b", "deepseek-v2-lite"],
)
def test_kv_bytes_per_token_of_known_models(config, per_token):
    assert kv_shape_from_config(config).bytes_per_token(16) == per_token


def test_a_sliding_window_holds_at_most_its_window():
    mistral = kv_shape_from_config(MISTRAL_7B)  # every layer slides over 4096 tokens
    per_token = 2 * 32 * 8 * 128 * 2
    assert mistral.sequence_bytes_per_gpu(1000, 16) == 1000 * per_token
    assert mistral.sequence_bytes_per_gpu(32768, 16) == 4096 * per_token


def test_gemma_2_alternates_window_and_full_layers():
    gemma = kv_shape_from_config(GEMMA_2_9B)
    assert gemma.windows[:4] == (4096, None, 4096, None)
    per_layer_token = 2 * 8 * 256 * 2
    # A full-length 8192-token sequence: 21 sliding layers hold 4096 tokens, 21 full layers hold 8192.
    assert gemma.sequence_bytes_per_gpu(8192, 16) == 21 * per_layer_token * 4096 + 21 * per_layer_token * 8192


def test_qwen2_window_applies_only_when_the_config_turns_it_on():
    off = kv_shape_from_config({**QWEN_2_5_7B, "sliding_window": 131072, "use_sliding_window": False})
    assert set(off.windows) == {None}
    on = kv_shape_from_config(
        {**QWEN_2_5_7B, "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 20}
    )
    assert on.windows.count(4096) == 8 and on.windows[19] is None and on.windows[20] == 4096


def test_tensor_parallel_splits_kv_heads_but_not_the_mla_latent():
    llama = kv_shape_from_config(LLAMA_3_1_70B)
    one = llama.sequence_bytes_per_gpu(1, 16)
    assert llama.sequence_bytes_per_gpu(1, 16, tensor_parallel=4) == one // 4
    # 8 KV heads on 16 GPUs: each GPU still holds one whole head (engines replicate them).
    assert llama.sequence_bytes_per_gpu(1, 16, tensor_parallel=16) == one // 8
    latent = kv_shape_from_config(DEEPSEEK_V2_LITE)
    assert latent.sequence_bytes_per_gpu(1, 16, tensor_parallel=2) == latent.sequence_bytes_per_gpu(1, 16)
    # Pipeline stages split the layers: 80 layers in 3 stages, the largest holds 27.
    assert llama.sequence_bytes_per_gpu(1, 16, pipeline_stages=3) == one * 27 // 80


def test_a_gguf_header_gives_the_kv_shape(tmp_path):
    header = read_weights_headers(write_tiny_llama(tmp_path / "tiny.gguf"))
    shape = kv_shape_from_header(header.shape)
    assert shape == KVShape.uniform(2, 4, 16)
    assert shape.bytes_per_token(16) == 2 * 2 * 4 * 16 * 2
    gemma = kv_shape_from_header(
        HeaderShape(architecture="gemma2", layers=4, heads=8, kv_heads=4, key_length=256, sliding_window=4096)
    )
    assert gemma.windows == (4096, None, 4096, None)
    mla = kv_shape_from_header(
        HeaderShape(architecture="deepseek2", layers=27, heads=16, kv_lora_rank=512, rope_dimensions=64)
    )
    assert mla.bytes_per_token(16) == (512 + 64) * 27 * 2
    assert kv_shape_from_header(HeaderShape(architecture="llama")) is None


def test_weights_come_from_the_best_source_given():
    from_config = estimate_weights(config=LLAMA_3_1_8B, parameters_billions=70, dtype="float32")
    assert (from_config.source, from_config.bytes) == ("config", 2 * 8_030_261_248)
    from_catalog = estimate_weights(config={"model_type": "mamba"}, parameters_billions=8, dtype="Q4_K")
    assert (from_catalog.source, from_catalog.bytes) == ("catalog", 8 * 10**9 * 9 // 16)
    unknown = estimate_weights(config={"model_type": "mamba"}, parameters_billions=8)
    assert unknown.bytes is None and "mamba" in unknown.detail and "no dtype" in unknown.detail
    assert estimate_weights(parameters_billions=8, dtype="float7").bytes is None
    assert estimate_weights().detail == "no weights headers, config.json or catalog size"


def test_weights_from_headers_win_over_everything(tmp_path):
    header = read_weights_headers(write_tiny_llama(tmp_path / "tiny.gguf"))
    estimate = estimate_weights(header=header, config=LLAMA_3_1_8B, parameters_billions=1, dtype="bf16")
    assert (estimate.source, estimate.bytes) == ("headers", header.total_bytes)


def llama_70b(max_model_len=8192, **options):
    return ProfileMemory(
        engine="vllm",
        weights=estimate_weights(config=LLAMA_3_1_70B),
        kv=kv_shape_from_config(LLAMA_3_1_70B),
        max_model_len=max_model_len,
        **options,
    )


def test_a_70b_model_on_two_l40s_does_not_fit_and_says_by_how_much():
    verdict = judge(llama_70b(tensor_parallel=2), L40S)
    weights = 2 * 70_553_706_496 // 2
    overhead = ENGINE_MEMORY["vllm"].overhead_bytes
    kv = 8192 * 2 * 80 * 4 * 128 * 2
    assert verdict.fit is Fit.DOES_NOT_FIT
    assert (verdict.weights_bytes, verdict.overhead_bytes, verdict.kv_bytes) == (weights, overhead, kv)
    assert verdict.needs_bytes == weights + overhead + kv
    assert verdict.usable_bytes == int(46068 * MIB * VLLM_MEMORY_FRACTION)
    assert verdict.sentence.startswith(
        f"needs {verdict.needs_gib} GiB per GPU; L40S-48GB has {verdict.usable_gib} GiB usable"
    )
    assert verdict.sequences is not None and verdict.sentence.count("room for") == 0


def test_the_same_model_fits_on_four_h100_with_room_for_full_length_sequences():
    verdict = judge(llama_70b(max_model_len=131072, tensor_parallel=4), H100)
    assert verdict.fit is Fit.FITS
    kv = 131072 * 2 * 80 * 2 * 128 * 2
    free = verdict.usable_bytes - verdict.weights_bytes - verdict.overhead_bytes
    assert verdict.kv_bytes == kv and verdict.sequences == free // kv >= 1
    assert f"room for {verdict.sequences} full-length sequences" in verdict.sentence
    assert verdict.to_json()["fit"] == "fits" and verdict.to_json()["kv_counted"] is True


def test_the_verdict_turns_at_exactly_the_usable_memory():
    kv = KVShape.uniform(1, 1, 64)
    overhead = ENGINE_MEMORY["vllm"].overhead_bytes
    gpu = GPUMemory("X-10GB", 10 * GIB)
    usable = int(10 * GIB * VLLM_MEMORY_FRACTION)
    exact = usable - overhead - 256 * 100  # 100 tokens of 256 bytes each

    def at(weights):
        return judge(ProfileMemory("vllm", WeightsEstimate(weights, "catalog", "test"), kv, "bf16", 100), gpu)

    assert at(exact).fit is Fit.FITS and at(exact).needs_bytes == usable and at(exact).sequences == 1
    assert at(exact + 1).fit is Fit.DOES_NOT_FIT


def test_unknown_size_is_no_verdict_and_unknown_kv_is_a_verdict_on_weights_alone():
    unknown = judge(ProfileMemory("vllm", estimate_weights(config={"model_type": "mamba"})), H100)
    assert unknown.fit is Fit.UNKNOWN and unknown.needs_bytes is None
    assert unknown.sentence.startswith("size unknown (config.json model_type 'mamba'")
    weights_only = judge(ProfileMemory("vllm", estimate_weights(parameters_billions=8, dtype="bf16")), H100)
    assert weights_only.fit is Fit.FITS and weights_only.kv_bytes is None and weights_only.sequences is None
    assert weights_only.needs_bytes == 16 * 10**9 + ENGINE_MEMORY["vllm"].overhead_bytes
    assert "KV cache not counted: its shape is unknown" in weights_only.sentence
    no_context = judge(llama_70b(max_model_len=None, tensor_parallel=8), H100)
    assert "KV cache not counted: the served context is unknown" in no_context.sentence


def test_engines_differ_in_their_share_and_overheads():
    profile = llama_70b(tensor_parallel=4)
    vllm, sglang = judge(profile, H100), judge(ProfileMemory(**{**vars(profile), "engine": "sglang"}), H100)
    assert sglang.overhead_bytes == 0 and sglang.usable_bytes < vllm.usable_bytes
    own = judge(llama_70b(tensor_parallel=4, memory_fraction=0.5), H100)
    assert own.usable_bytes == int(H100.memory_bytes * 0.5)
    fp8 = judge(llama_70b(tensor_parallel=4, kv_dtype="fp8"), H100)
    assert fp8.kv_bytes * 2 == vllm.kv_bytes
    with pytest.raises(ValueError, match="unknown engine 'trt'"):
        judge(ProfileMemory("trt", profile.weights), H100)
    with pytest.raises(ValueError, match="memory fraction"):
        judge(llama_70b(memory_fraction=1.5), H100)


def test_the_served_context_defaults_to_the_models_own():
    assert served_context({"max_position_embeddings": 131072}, None) == 131072
    assert served_context({"max_position_embeddings": 131072}, 8192) == 8192
    assert served_context(None, None) is None


def test_vllm_serves_a_float32_checkpoint_in_sixteen_bits_and_llamacpp_as_stored(tmp_path):
    served = estimate_weights(config=GEMMA_2_9B, engine="vllm")  # Gemma 2's config says float32
    assert (served.bytes, served.compute_dtype) == (2 * 9_241_705_984, "bfloat16")
    assert "served as bfloat16" in served.detail
    assert estimate_weights(config=GEMMA_2_9B, engine="llamacpp").bytes == 4 * 9_241_705_984
    assert estimate_weights(config=LLAMA_3_1_8B, engine="vllm").bytes == 2 * 8_030_261_248
    tensors = random_tensors(np.random.default_rng(5), {"a": ("F32", (64, 64)), "b": ("BF16", (8, 64))})
    write_safetensors(tmp_path / "model.safetensors", tensors)
    header = read_weights_headers(tmp_path)
    assert estimate_weights(header=header).bytes == header.total_bytes == 64 * 64 * 4 + 8 * 64 * 2
    halved = estimate_weights(header=header, engine="vllm")
    assert (halved.bytes, halved.compute_dtype) == (64 * 64 * 2 + 8 * 64 * 2, "bfloat16")


# The tiny Llama of the real-vLLM tests (random weights, written by transformers; config.json facts), and what
# vLLM 0.32's CPU build logged serving it with VLLM_CPU_KVCACHE_SPACE=1: "dtype=torch.bfloat16" and
# "CPU KV cache size: 1,048,576 tokens" for 1 GiB of KV cache.
TINY_LLAMA = dense("llama", 256, 512, 2, 4, 2, 512, head_dim=64, dtype="float32", tie_word_embeddings=False)


def test_kv_per_token_matches_what_vllm_logged_for_the_tiny_llama():
    weights = estimate_weights(config=TINY_LLAMA, engine="vllm")
    per_token = kv_shape_from_config(TINY_LLAMA).bytes_per_token(dtype_bits(weights.compute_dtype))
    assert per_token == GIB // 1_048_576 == 1024
    assert weights.parameters == 1_443_072  # the elements of its model.safetensors


def test_sliding_layers_keep_the_batches_vllm_holds_in_flight():
    assert window_slack_tokens("vllm", H100) == 2 * 8192
    assert window_slack_tokens("vllm", GPUMemory("A100-80GB", 81920 * MIB)) == 2 * 2048
    assert window_slack_tokens("vllm", GPUMemory("B200-180GB", 180 * GIB)) == 2 * 16384
    assert window_slack_tokens("vllm", L40S) == 2 * 2048
    assert (window_slack_tokens("llamacpp", H100), window_slack_tokens("sglang", H100)) == (512, 0)
    profile = ProfileMemory(
        "vllm", estimate_weights(config=GEMMA_2_9B, engine="vllm"), kv_shape_from_config(GEMMA_2_9B)
    )
    verdict = judge(ProfileMemory(**{**vars(profile), "max_model_len": 131072}), H100)
    per_layer_token = 2 * 8 * 256 * 2  # bfloat16: the compute dtype vLLM serves Gemma 2 in
    assert verdict.kv_bytes == 21 * per_layer_token * (4096 + 16384) + 21 * per_layer_token * 131072


def test_engine_args_give_the_share_the_context_and_the_kv_dtype():
    args = ["--gpu-memory-utilization", "0.8", "--max-model-len=32k", "--kv-cache-dtype", "fp8", "--enforce-eager"]
    assert memory_args("vllm", args) == MemoryArgs(0.8, 32000, "fp8")
    assert memory_args("vllm", ["--max-model-len", "128K", "--kv-cache-dtype", "auto"]) == MemoryArgs(
        None, 131072, None
    )
    assert memory_args("sglang", ["--mem-fraction-static", "0.7", "--context-length", "8192"]) == MemoryArgs(0.7, 8192)
    assert memory_args("llamacpp", ["-c", "0", "--n-gpu-layers", "99"]) == MemoryArgs()
    assert memory_args("llamacpp", ["--ctx-size", "4096"]).max_model_len == 4096
    assert memory_args("vllm", ["--context-length", "4096"]) == MemoryArgs()  # SGLang's flag, not vLLM's
    for bad in (
        ["--gpu-memory-utilization", "1.5"],
        ["--max-model-len", "lots"],
        ["--kv-cache-dtype", "fp5"],
        ["--max-model-len"],
    ):
        with pytest.raises(ValueError, match=f"engine arg {bad[0]}"):
            memory_args("vllm", bad)


# Context spellings each engine reads differently from the reader before it: vLLM 0.32's
# human_readable_int_or_auto, SGLang 0.5.23's human_readable_int, llama.cpp's std::stoi.
CONTEXTS_TAKEN = [
    ("vllm", "auto", None),  # the model's own, which vLLM then fits to the KV cache memory
    ("vllm", " AUTO ", None),
    ("vllm", "-1", None),
    ("vllm", "1G", 2**30),
    ("vllm", "1g", 10**9),
    ("vllm", "2T", 2 * 2**40),
    ("vllm", "1t", 10**12),
    ("mock", "auto", None),
    ("sglang", "1Ki", 1024),
    ("sglang", "2Mi", 2 * 2**20),
    ("sglang", "1M", 10**6),  # SI: vLLM's 1M is 2**20
    ("sglang", "4.5M", 4_500_000),
    ("sglang", "1G", 10**9),
]
CONTEXTS_REFUSED = [
    ("vllm", "1.5K", "no decimals with the binary suffix K"),
    ("vllm", "2.5M", "no decimals with the binary suffix M"),
    ("vllm", "0", "at least 1 token"),
    ("vllm", "0k", "at least 1 token"),
    ("vllm", "1e3k", "vLLM takes"),
    ("vllm", "1 k", "vLLM takes"),
    ("sglang", "32K", "SGLang takes"),  # SGLang's suffixes are case-sensitive: k, M, G, T, Ki, Mi, Gi, Ti
    ("sglang", "1m", "SGLang takes"),
    ("sglang", "0", "leave the flag out for the model's own"),
    ("llamacpp", "32k", "reads 32k as 32"),  # std::stoi stops at the k: 32 tokens
    ("llamacpp", "4K", "plain integer"),
    ("llamacpp", "1.5k", "plain integer"),
    ("llamacpp", "2147483648", "to 2147483647"),
]
CONTEXT_FLAGS = {"vllm": "--max-model-len", "mock": "--max-model-len", "sglang": "--context-length", "llamacpp": "-c"}


@pytest.mark.parametrize(("engine", "value", "tokens"), CONTEXTS_TAKEN)
def test_each_engine_reads_the_context_spellings_it_accepts(engine, value, tokens):
    assert memory_args(engine, [CONTEXT_FLAGS[engine], value]).max_model_len == tokens
    assert refused_value(engine, [CONTEXT_FLAGS[engine], value]) is None


@pytest.mark.parametrize(("engine", "value", "why"), CONTEXTS_REFUSED)
def test_each_engine_refuses_the_context_spellings_it_refuses_naming_the_value(engine, value, why):
    args = [CONTEXT_FLAGS[engine], value]
    with pytest.raises(ValueError, match=f"engine arg {CONTEXT_FLAGS[engine]}: {re.escape(repr(value))}.*{why}"):
        memory_args(engine, args)
    assert why in refused_value(engine, args)


@pytest.mark.parametrize(
    ("engine", "args", "why"),
    [
        ("vllm", ["--max-model-len=", "8192"], "vLLM takes"),  # the empty value, not the next argument
        ("llamacpp", ["--ctx-size=4096"], "no --flag=value"),  # llama.cpp looks `--ctx-size=4096` up as a flag
    ],
)
def test_a_context_the_engine_cannot_parse_from_the_argv_is_refused(engine, args, why):
    with pytest.raises(ValueError, match=why):
        memory_args(engine, args)


# --kv-cache-dtype values each engine takes that the reader before refused (vLLM 0.32's CacheDType, SGLang
# 0.5.23's choices), and the dtype the estimate counts: None where the size is not known from the args.
KV_DTYPES_TAKEN = [
    ("vllm", "fp8_inc", "fp8_inc"),
    ("mock", "fp8_inc", "fp8_inc"),
    ("vllm", "nvfp4_4over6", "nvfp4_4over6"),
    ("vllm", "ultraquant_4bit", "ultraquant_4bit"),
    ("vllm", "turboquant_k8v4", "turboquant_k8v4"),
    ("vllm", "turboquant_4bit_nc", "turboquant_4bit_nc"),
    ("vllm", "turboquant_k3v4_nc", "turboquant_k3v4_nc"),
    ("vllm", "turboquant_3bit_nc", "turboquant_3bit_nc"),
    ("vllm", "int4_per_token_head", "int4_per_token_head"),
    ("vllm", "int8_per_token_head", "int8_per_token_head"),
    ("vllm", "fp8_per_token_head", "fp8_per_token_head"),
    ("vllm", "fp8_ds_mla", None),  # a per-model blob: the model's dtype is counted
    ("vllm", "nvfp4_ds_mla", None),
    ("sglang", "mxfp8", "mxfp8"),
    ("sglang", "nvfp4", None),  # scale layouts as the attention backend needs them
    ("sglang", "fp4_mx_block16", None),
]
# Values the reader before took and the engine's parser refuses (argparse choices, case as written).
KV_DTYPES_REFUSED = [
    ("vllm", "FP8"),
    ("vllm", "int8"),  # vLLM's is int8_per_token_head
    ("vllm", "float32"),
    ("vllm", "Q8_0"),
    ("sglang", "fp8"),  # SGLang names fp8_e4m3 or fp8_e5m2
    ("sglang", "float16"),  # SGLang's 16-bit choices are bf16 and bfloat16
]


@pytest.mark.parametrize(("engine", "value", "counted"), KV_DTYPES_TAKEN)
def test_each_engine_takes_its_kv_cache_dtypes(engine, value, counted):
    args = ["--gpu-memory-utilization" if engine != "sglang" else "--mem-fraction-static", "0.5"]
    assert memory_args(engine, [*args, "--kv-cache-dtype", value]) == MemoryArgs(0.5, None, counted)
    assert refused_value(engine, ["--kv-cache-dtype", value]) is None


@pytest.mark.parametrize(("engine", "value"), KV_DTYPES_REFUSED)
def test_a_kv_cache_dtype_the_engine_refuses_is_refused_naming_it(engine, value):
    takes = {"vllm": "vLLM takes auto, float16", "sglang": "SGLang takes auto, bf16"}[engine]
    with pytest.raises(ValueError, match=f"engine arg --kv-cache-dtype: {value!r} is not a valid value \\({takes}"):
        memory_args(engine, ["--kv-cache-dtype", value])
    assert takes in refused_value(engine, [f"--kv-cache-dtype={value}"])


# Bytes per token of one layer with one KV head, as the engines lay each dtype out (scales included).
KV_BYTES = [
    ("vllm", "fp8_inc", KVShape.uniform(1, 1, 128), 256),
    ("vllm", "nvfp4_4over6", KVShape.uniform(1, 1, 128), 2 * (64 + 8)),  # nvfp4_kv_cache_full_dim: D/2 + D/16
    ("vllm", "ultraquant_4bit", KVShape.uniform(1, 1, 128), 136),  # its format.py: D=128 -> 136 B/slot
    ("vllm", "ultraquant_4bit", KVShape.uniform(1, 1, 256), 272),  # D=256 -> 272
    ("vllm", "int8_per_token_head", KVShape.uniform(1, 1, 128), 256 + 2 * 4),  # one fp32 scale for K, one for V
    ("vllm", "fp8_per_token_head", KVShape.uniform(1, 1, 128), 264),
    ("vllm", "int4_per_token_head", KVShape.uniform(1, 1, 128), 128 + 8),
    ("vllm", "int8_per_token_head", KVShape.latent(1, 576), 576 + 8),  # MLA: one scale pair per latent
    ("vllm", "turboquant_k8v4", KVShape.uniform(1, 1, 128), 128 + 64 + 4),  # fp8 keys; values + fp16 scale, zero
    ("vllm", "turboquant_4bit_nc", KVShape.uniform(1, 1, 128), 64 + 2 + 64 + 4),  # keys + fp16 norm
    ("vllm", "turboquant_k3v4_nc", KVShape.uniform(1, 1, 128), 48 + 2 + 64 + 4),
    ("vllm", "turboquant_3bit_nc", KVShape.uniform(1, 1, 128), 48 + 2 + 48 + 4),
    ("vllm", "turboquant_3bit_nc", KVShape.uniform(1, 1, 96), 36 + 2 + 36 + 4),
    ("vllm", "turboquant_k3v4_nc", KVShape.uniform(1, 1, 72), 27 + 2 + 36 + 4 + 1),  # rounded up to even
    ("sglang", "mxfp8", KVShape.uniform(1, 1, 128), 256 + 256 // 32),  # one UE8M0 scale byte per 32
]


@pytest.mark.parametrize(("engine", "dtype", "shape", "per_token"), KV_BYTES)
def test_each_kv_cache_dtype_is_counted_as_the_engine_stores_it(engine, dtype, shape, per_token):
    assert shape.bytes_per_token(kv_cache_bits(engine, dtype, *shape.slot_dims)) == per_token


def test_a_verdict_counts_the_kv_cache_dtype_the_args_give():
    weights = estimate_weights(config=GEMMA_2_9B, engine="vllm")
    args = memory_args("vllm", ["--kv-cache-dtype", "ultraquant_4bit", "--max-model-len", "8192"])
    profile = ProfileMemory("vllm", weights, kv_shape_from_config(GEMMA_2_9B), args.kv_dtype, args.max_model_len)
    # Gemma 2 9B: 42 layers of 8 KV heads of 256 (half of them within a 4096 window), 272 bytes per head.
    per_layer_token = 8 * 272
    assert judge(profile, H100).kv_bytes == 21 * per_layer_token * 8192 + 21 * per_layer_token * 8192


# Flag spellings the engines take for the same flag, which the reader before passed over.
SPELLINGS = [
    ("vllm", ["--max_model_len", "4096"], MemoryArgs(max_model_len=4096)),  # FlexibleArgumentParser: _ -> -
    ("vllm", ["--max_model_len=4k"], MemoryArgs(max_model_len=4000)),
    ("vllm", ["--gpu_memory_utilization", "0.5"], MemoryArgs(memory_fraction=0.5)),
    ("vllm", ["--kv_cache_dtype=fp8"], MemoryArgs(kv_dtype="fp8")),
    ("vllm", ["--device-memory-utilization", "0.6"], MemoryArgs(memory_fraction=0.6)),  # vLLM's alias
    ("vllm", ["--device_memory_utilization", "0.6"], MemoryArgs(memory_fraction=0.6)),
    ("mock", ["--max_model_len", "4096"], MemoryArgs(max_model_len=4096)),
    ("llamacpp", ["--ctx_size", "4096"], MemoryArgs(max_model_len=4096)),  # common/arg.cpp: every _ -> -
]


@pytest.mark.parametrize(("engine", "args", "read"), SPELLINGS)
def test_each_engine_reads_its_flags_in_every_spelling_it_takes(engine, args, read):
    assert memory_args(engine, args) == read


def test_spellings_an_engine_does_not_take_are_not_its_flags():
    assert memory_args("sglang", ["--context_length", "4096"]) == MemoryArgs()  # plain argparse: no such flag
    assert memory_args("vllm", ["-max_model_len", "4096"]) == MemoryArgs()  # one dash: vLLM leaves it be
    with pytest.raises(ValueError, match="no --flag=value"):
        memory_args("llamacpp", ["--ctx_size=4096"])  # --ctx-size=4096 to llama.cpp: not a flag


def test_each_engine_spreads_a_replica_as_it_is_started():
    assert parallel_shape("vllm", 8, 2) == (8, 2)
    assert parallel_shape("sglang", 8, 2) == (16, 1)
    assert parallel_shape("llamacpp", 2, 1) == (1, 2)
