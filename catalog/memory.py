"""Will a profile fit its GPUs? The memory model: weights, KV cache and engine overheads per GPU.

The rule is the one vLLM applies at start-up (vllm/v1/worker/gpu_worker.py
`determine_available_memory`, vllm/v1/core/kv_cache_utils.py
`check_enough_kv_cache_memory`): the engine may use `total × gpu_memory_utilization`
of each GPU; from that it takes the weights, the peak activations of a profiling
forward pass, the memory outside torch (CUDA context, NCCL) and its CUDA graphs;
what is left is KV cache, and if that cannot hold one sequence of
`max_model_len` tokens the engine refuses to start. So, per GPU:

    needs  = weights ÷ (tensor-parallel size × pipeline stages)
           + the engine's fixed overheads (constants below, each with its source)
           + KV cache of one full-length sequence on that GPU
    usable = GPU memory × the engine's memory fraction
    fits   = needs ≤ usable; full-length sequences that fit beside the
             weights = (usable − weights − overheads) ÷ KV of one sequence

Weights bytes, best source first (`estimate_weights`):

1. the weights' own headers (agent/weights_headers.py): exact file bytes;
2. a model folder's `config.json`: parameters counted from the architecture
   (`parameter_count`) × the dtype (`torch_dtype`, or `quantization_config`:
   AWQ/GPTQ pack linear weights at `bits` plus a 16-bit scale and a `bits`
   zero point per group; FP8 at one byte; bitsandbytes 4/8-bit);
3. the operator's catalog fields `parameters_billions` and `dtype`.
vLLM and SGLang serve a float32 checkpoint in bfloat16 (their `--dtype auto`),
so its float32 tensors count half their file bytes there; the KV cache takes
the dtype the engine computes in unless the profile names one (`--kv-cache-dtype`).
Nothing known, or a quantization the model does not know, is "unknown": no
verdict, never a guess presented as a fact.

Parameter counts are what the checkpoint holds: embeddings (once when tied to
the output head), attention projections with the family's biases, the gated
MLP (gate, up, down), routed and shared experts with their routers, and every
RMSNorm (two per layer; Gemma 2 four; DeepSeek's MLA adds its latent norms).
The families and their config keys follow Hugging Face `transformers`
(`modeling_llama`, `modeling_qwen2`, `modeling_mixtral`, `modeling_qwen2_moe`,
`modeling_gemma2`, `modeling_phi3`, `modeling_deepseek_v2`); DeepSeek-V3's
multi-token-prediction layers are not counted (engines do not load them unless
asked to speculate).

KV cache per token and layer: 2 × KV heads × head dim × KV dtype bytes (K and
V); multi-head latent attention (DeepSeek-V2/V3) keeps one latent of
`kv_lora_rank + qk_rope_head_dim` per layer instead. A sliding-window layer
holds its window and what the engine keeps for batches in flight: for a
full-length sequence of L tokens it counts min(L, window + slack) tokens
(`window_slack_tokens`: vLLM's sliding-window KV spec reserves the window plus
two batches of `max_num_batched_tokens`; llama.cpp's SWA cache one
micro-batch). Gemma 2 alternates (even layers slide, window 4096), so under
vLLM on an H100 a 131072-token sequence costs 21 layers × (4096 + 16384) + 21
layers × 131072 tokens. Under tensor parallelism each GPU holds ceil(KV heads ÷ TP) heads (heads are
replicated when TP exceeds them) but the whole MLA latent; pipeline stages
split the layers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from typing import Any, Literal

from agent.weights_headers import HeaderShape, WeightsHeader, ggml_bits_per_weight

GIB = 1 << 30
MIB = 1 << 20

# Bits per element of the dtype names configs and operators use (torch_dtype, vLLM --dtype/--kv-cache-dtype).
DTYPE_BITS: dict[str, int] = {
    "float32": 32,
    "fp32": 32,
    "float": 32,
    "float16": 16,
    "fp16": 16,
    "half": 16,
    "bfloat16": 16,
    "bf16": 16,
    "fp8": 8,
    "fp8_e4m3": 8,
    "fp8_e5m2": 8,
    "float8": 8,
    "int8": 8,
    "int4": 4,
}


# vLLM and SGLang serve a float32 checkpoint in 16 bits (`--dtype auto`: vLLM's model config picks bfloat16,
# float16 where the device lacks it; vLLM 0.32 logs dtype=torch.bfloat16 for a float32 model and casts each
# tensor as it loads). llama.cpp holds GGUF tensors as stored.
HALVES_FLOAT32 = frozenset({"vllm", "sglang", "mock"})
SAFETENSORS_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class ConfigError(ValueError):
    """A config.json the memory model cannot count: an unknown family or a missing or malformed key."""


def dtype_bits(name: str) -> Fraction:
    """Bits per weight of a dtype name: torch/vLLM names, or a ggml type (Q4_K: 144 bytes per 256 = 4.5)."""
    key = name.strip().lower().removeprefix("torch.")
    if key in DTYPE_BITS:
        return Fraction(DTYPE_BITS[key])
    bits = ggml_bits_per_weight(name.strip())
    if bits is None:
        raise ValueError(
            f"unknown dtype {name!r}: use one of {', '.join(sorted(DTYPE_BITS))} or a ggml type (Q4_K, Q8_0, …)"
        )
    return bits


@dataclass(frozen=True)
class Family:
    """How one architecture family lays out its weights (Hugging Face `transformers` modeling code)."""

    tied_default: bool = False  # tie_word_embeddings when the config omits it
    qkv_bias: bool = False  # Qwen2: biases on q, k and v (not o)
    norms_per_layer: int = 2  # RMSNorms of `hidden` per layer (Gemma 2: four)
    qk_norm: bool = False  # Qwen3: RMSNorm of `head_dim` on q and on k
    experts: Literal["", "mixtral", "qwen_moe", "deepseek"] = ""
    mla: bool = False  # multi-head latent attention (DeepSeek-V2/V3)
    router_bias: bool = False  # DeepSeek-V3: e_score_correction_bias per routed expert


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "phi3": Family(),  # fused qkv_proj / gate_up_proj: the same counts as separate ones
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_norm=True),
    "gemma": Family(tied_default=True),
    "gemma2": Family(tied_default=True, norms_per_layer=4),
    "mixtral": Family(experts="mixtral"),
    "qwen2_moe": Family(qkv_bias=True, experts="qwen_moe"),
    "qwen3_moe": Family(qk_norm=True, experts="qwen_moe"),
    "deepseek_v2": Family(experts="deepseek", mla=True),
    "deepseek_v3": Family(experts="deepseek", mla=True, router_bias=True),
}


@dataclass(frozen=True)
class ParameterCount:
    """A model's parameters: `linear` is the projection matrices (what weight quantization packs),
    `embedding` the token embeddings and output head, the rest norms, biases and routers."""

    total: int
    embedding: int
    linear: int

    @property
    def other(self) -> int:
        return self.total - self.embedding - self.linear


class _Config:
    """Typed reads of a config.json dict, each failure a ConfigError naming the key."""

    def __init__(self, config: Mapping[str, Any]):
        self.raw = config

    def whole(self, key: str, default: int | None = None) -> int:
        value = self.raw.get(key, default)
        if value is None and default is not None:
            value = default
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"config.json {key} must be a whole number, got {value!r}")
        return value

    def optional_int(self, key: str) -> int | None:
        return None if self.raw.get(key) is None else self.whole(key)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        return default if value is None else bool(value)


def family_of(config: Mapping[str, Any]) -> Family:
    """The family of a config.json (its `model_type`), or ConfigError if the memory model does not count it."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(
            f"config.json model_type {model_type!r} is not one the memory model counts ({', '.join(sorted(FAMILIES))})"
        )
    return FAMILIES[model_type]


def parameter_count(config: Mapping[str, Any]) -> ParameterCount:
    """The parameters a checkpoint with this config.json holds (ConfigError if it cannot say)."""
    family = family_of(config)
    c = _Config(config)
    hidden, vocab, layers = c.whole("hidden_size"), c.whole("vocab_size"), c.whole("num_hidden_layers")
    tied = c.flag("tie_word_embeddings", family.tied_default)
    embedding = vocab * hidden * (1 if tied else 2)
    linear = other = 0
    attention_linear, attention_other = _mla_attention(c, hidden) if family.mla else _attention(c, family, hidden)
    for layer in range(layers):
        mlp_linear, mlp_other = _mlp(c, family, hidden, layer)
        linear += attention_linear + mlp_linear
        other += attention_other + mlp_other + family.norms_per_layer * hidden
    other += hidden  # the final norm
    return ParameterCount(total=embedding + linear + other, embedding=embedding, linear=linear)


def _attention(c: _Config, family: Family, hidden: int) -> tuple[int, int]:
    """(linear, other) parameters of one grouped-query attention block."""
    heads = c.whole("num_attention_heads")
    if heads == 0:
        raise ConfigError("config.json num_attention_heads must be at least 1")
    kv_heads = c.whole("num_key_value_heads", heads)
    head_dim = c.whole("head_dim", hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    linear = hidden * q + 2 * hidden * kv + q * hidden
    other = 0
    if family.qkv_bias:
        other += q + 2 * kv
    elif c.flag("attention_bias", False):
        other += q + 2 * kv + hidden
    if family.qk_norm:
        other += 2 * head_dim
    return linear, other


def _mla_attention(c: _Config, hidden: int) -> tuple[int, int]:
    """(linear, other) parameters of DeepSeek's multi-head latent attention block."""
    heads = c.whole("num_attention_heads")
    q_lora, kv_lora = c.optional_int("q_lora_rank"), c.whole("kv_lora_rank")
    nope, rope, v_dim = c.whole("qk_nope_head_dim"), c.whole("qk_rope_head_dim"), c.whole("v_head_dim")
    q_out = heads * (nope + rope)
    if q_lora:  # q_a_proj, its norm, q_b_proj
        linear, other = hidden * q_lora + q_lora * q_out, q_lora
    else:
        linear, other = hidden * q_out, 0
    linear += hidden * (kv_lora + rope)  # kv_a_proj_with_mqa: the latent and the shared rope key
    other += kv_lora  # kv_a_layernorm
    linear += kv_lora * heads * (nope + v_dim)  # kv_b_proj
    linear += heads * v_dim * hidden  # o_proj
    return linear, other


def _mlp(c: _Config, family: Family, hidden: int, layer: int) -> tuple[int, int]:
    """(linear, other) parameters of layer `layer`'s MLP: dense, or experts with their router."""
    if family.experts == "mixtral":
        experts = c.whole("num_local_experts")
        return experts * 3 * hidden * c.whole("intermediate_size"), hidden * experts
    if family.experts == "qwen_moe":
        step = c.whole("decoder_sparse_step", 1)
        if layer in (c.raw.get("mlp_only_layers") or []) or step == 0 or (layer + 1) % step:
            return 3 * hidden * c.whole("intermediate_size"), 0
        experts, expert = c.whole("num_experts"), 3 * hidden * c.whole("moe_intermediate_size")
        shared = c.whole("shared_expert_intermediate_size", 0)
        # Qwen2-MoE's shared expert has a one-output gate; Qwen3-MoE has no shared expert.
        return experts * expert + 3 * hidden * shared, hidden * experts + (hidden if shared else 0)
    if family.experts == "deepseek":
        frequency = c.whole("moe_layer_freq", 1)
        if layer < c.whole("first_k_dense_replace", 0) or frequency == 0 or layer % frequency:
            return 3 * hidden * c.whole("intermediate_size"), 0
        experts, expert_width = c.whole("n_routed_experts"), c.whole("moe_intermediate_size")
        shared = 3 * hidden * expert_width * c.whole("n_shared_experts", 0)
        router = hidden * experts + (experts if family.router_bias else 0)
        return experts * 3 * hidden * expert_width + shared, router
    return 3 * hidden * c.whole("intermediate_size"), 0


@dataclass(frozen=True)
class WeightsEstimate:
    """The weights' bytes and where the figure comes from; `bytes` None = unknown, `detail` says why."""

    bytes: int | None
    source: Literal["headers", "config", "catalog", "unknown"]
    detail: str
    parameters: int | None = None
    compute_dtype: str | None = None  # what the engine computes in, so the KV cache's default dtype


def config_dtype(config: Mapping[str, Any]) -> str:
    """The dtype a config.json's weights are stored in (`torch_dtype`, or `dtype` in newer files)."""
    value = config.get("torch_dtype") or config.get("dtype") or "float32"  # transformers' own default
    if not isinstance(value, str):
        raise ConfigError(f"config.json torch_dtype must be a string, got {value!r}")
    return value


def config_weights_bytes(config: Mapping[str, Any], dtype: str | None = None) -> int:
    """Bytes of a checkpoint's weights from its config.json: parameters × dtype (the config's own unless
    given), quantized linears packed."""
    count = parameter_count(config)
    base = _known_dtype_bits(dtype or config_dtype(config))
    quantization = config.get("quantization_config")
    if not quantization:
        return _bytes(count.total * base)
    linear_bits = _quantized_linear_bits(quantization)
    return _bytes(count.linear * linear_bits + (count.total - count.linear) * base)


def _known_dtype_bits(name: str) -> Fraction:
    try:
        return dtype_bits(name)
    except ValueError as exc:
        raise ConfigError(f"config.json: {exc}") from None


def _quantized_linear_bits(quantization: Any) -> Fraction:
    """Bits per linear weight under a config's quantization_config (ConfigError for a method not known here)."""
    if not isinstance(quantization, Mapping):
        raise ConfigError("config.json quantization_config must be an object")
    method = str(quantization.get("quant_method", "")).lower()
    if method in ("awq", "gptq"):
        bits = quantization.get("bits", quantization.get("w_bit"))
        group = quantization.get("group_size", quantization.get("q_group_size", 128))
        if not isinstance(bits, int) or not isinstance(group, int) or bits <= 0:
            raise ConfigError(f"config.json quantization_config ({method}) needs whole `bits` and `group_size`")
        # Per group of input features: one 16-bit scale and one `bits` zero point per output (-1 = one group).
        return Fraction(bits) + (Fraction(16 + bits, group) if group > 0 else 0)
    if method == "fp8":
        return Fraction(8)
    if method == "bitsandbytes":
        if quantization.get("load_in_4bit"):
            return Fraction(4) + Fraction(32, 64)  # one fp32 absmax per block of 64
        if quantization.get("load_in_8bit"):
            return Fraction(8)
    raise ConfigError(f"config.json quantization method {method or '(none)'!r} is not one the memory model sizes")


def _bytes(bits: Fraction | int) -> int:
    return math.ceil(Fraction(bits) / 8)


def estimate_weights(
    *,
    header: WeightsHeader | None = None,
    config: Mapping[str, Any] | None = None,
    parameters_billions: float | None = None,
    dtype: str | None = None,
    engine: str | None = None,
) -> WeightsEstimate:
    """The weights' bytes as `engine` holds them, from the best source given: headers, config.json, catalog."""
    if header is not None:
        return _from_header(header, engine)
    problems = []
    if config is not None:
        try:
            return _from_config(config, engine)
        except ConfigError as exc:
            problems.append(str(exc))
    if parameters_billions is not None and dtype:
        try:
            bits = dtype_bits(dtype)
        except ValueError as exc:
            problems.append(str(exc))
        else:
            parameters = round(parameters_billions * 1e9)
            detail = f"catalog: {parameters_billions} B parameters in {dtype}"
            compute = dtype if dtype.lower() in DTYPE_BITS and bits >= 16 else None
            return WeightsEstimate(_bytes(parameters * bits), "catalog", detail, parameters, compute)
    elif parameters_billions is not None or dtype:
        given = "parameters_billions but no dtype" if dtype is None else "a dtype but no parameters_billions"
        problems.append(f"the catalog gives {given}")
    return WeightsEstimate(None, "unknown", "; ".join(problems) or "no weights headers, config.json or catalog size")


def served_dtype(engine: str | None, stored: str) -> str:
    """The dtype `engine` computes in for weights stored in `stored` (float32 served in 16 bits by vLLM/SGLang)."""
    if engine in HALVES_FLOAT32 and DTYPE_BITS.get(stored.lower().removeprefix("torch.")) == 32:
        return "bfloat16"
    return stored


def _from_config(config: Mapping[str, Any], engine: str | None) -> WeightsEstimate:
    count = parameter_count(config)
    stored = config_dtype(config)
    served = served_dtype(engine, stored)
    detail = f"config.json ({stored}" + (f", served as {served})" if served != stored else ")")
    return WeightsEstimate(config_weights_bytes(config, served), "config", detail, count.total, served)


def _from_header(header: WeightsHeader, engine: str | None) -> WeightsEstimate:
    detail = f"{header.format} headers of {len(header.files)} file(s)"
    if header.format == "gguf":  # llama.cpp holds GGUF tensors as stored and computes the KV cache in f16
        return WeightsEstimate(header.total_bytes, "headers", detail, header.elements, "float16")
    floats = {name: header.bytes_by_dtype.get(tag, 0) for tag, name in SAFETENSORS_FLOATS.items()}
    stored = max(floats, key=lambda name: floats[name]) if any(floats.values()) else None
    total = header.total_bytes
    if engine in HALVES_FLOAT32 and floats["float32"]:
        total -= floats["float32"] // 2
        detail += ", float32 served as bfloat16"
    return WeightsEstimate(total, "headers", detail, header.elements, stored and served_dtype(engine, stored))


@dataclass(frozen=True)
class KVShape:
    """What each layer keeps per token: `kv_heads[i]` heads of `key_dim` + `value_dim`, or (MLA) one latent
    of `latent_dim`; `windows[i]` is layer i's sliding window (None: it attends to the whole sequence)."""

    kv_heads: tuple[int, ...]
    key_dim: int
    value_dim: int
    windows: tuple[int | None, ...]
    latent_dim: int = 0

    @classmethod
    def uniform(
        cls,
        layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        windows: tuple[int | None, ...] | None = None,
    ) -> KVShape:
        return cls(
            (kv_heads,) * layers, head_dim, head_dim if value_dim is None else value_dim, windows or (None,) * layers
        )

    @classmethod
    def latent(cls, layers: int, latent_dim: int) -> KVShape:
        return cls((0,) * layers, 0, 0, (None,) * layers, latent_dim)

    @property
    def layers(self) -> int:
        return len(self.kv_heads)

    def layer_bytes_per_token(self, layer: int, kv_bits: Fraction | int, tensor_parallel: int = 1) -> Fraction:
        """Bytes one token takes in one layer's cache on one GPU of a tensor-parallel group."""
        if self.latent_dim:
            return Fraction(self.latent_dim * kv_bits, 8)  # one latent, whole on every rank
        heads = math.ceil(self.kv_heads[layer] / tensor_parallel)
        return Fraction(heads * (self.key_dim + self.value_dim) * kv_bits, 8)

    def bytes_per_token(self, kv_bits: Fraction | int) -> int:
        """KV bytes per token over all layers, windows aside (the figure engines log per token)."""
        return _bytes(sum(self.layer_bytes_per_token(i, kv_bits) * 8 for i in range(self.layers)))

    def sequence_bytes_per_gpu(
        self,
        tokens: int,
        kv_bits: Fraction | int,
        tensor_parallel: int = 1,
        pipeline_stages: int = 1,
        window_slack: int = 0,
    ) -> int:
        """KV bytes of one `tokens`-long sequence on the most loaded GPU of the group.

        A windowed layer holds its window plus `window_slack` tokens (what the
        engine keeps for batches in flight), never more than the sequence.
        """
        per_stage = math.ceil(self.layers / pipeline_stages)
        stages = [range(s, min(s + per_stage, self.layers)) for s in range(0, self.layers, per_stage)]

        def held(layer: int) -> int:
            window = self.windows[layer]
            return tokens if window is None else min(tokens, window + window_slack)

        stage_bits = (
            sum(self.layer_bytes_per_token(i, kv_bits, tensor_parallel) * 8 * held(i) for i in stage)
            for stage in stages
        )
        return max((_bytes(bits) for bits in stage_bits), default=0)


def kv_shape_from_config(config: Mapping[str, Any]) -> KVShape:
    """The KV cache shape a config.json describes (ConfigError if the family or a key is unknown)."""
    family = family_of(config)
    c = _Config(config)
    layers = c.whole("num_hidden_layers")
    if family.mla:
        return KVShape.latent(layers, c.whole("kv_lora_rank") + c.whole("qk_rope_head_dim"))
    heads = c.whole("num_attention_heads")
    if heads == 0:
        raise ConfigError("config.json num_attention_heads must be at least 1")
    head_dim = c.whole("head_dim", c.whole("hidden_size") // heads)
    return KVShape.uniform(layers, c.whole("num_key_value_heads", heads), head_dim, windows=_config_windows(c, layers))


def _config_windows(c: _Config, layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window as the config says: `layer_types`, Gemma 2's alternation, Qwen2's
    `use_sliding_window` above `max_window_layers`, or one window for every layer (Mistral v0.1, Phi-3)."""
    window = c.optional_int("sliding_window")
    model_type = c.raw.get("model_type")
    types = c.raw.get("layer_types")
    if window and isinstance(types, list) and len(types) == layers:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if not window:
        return (None,) * layers
    if model_type == "gemma2":
        return tuple(window if i % 2 == 0 else None for i in range(layers))
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        if not c.flag("use_sliding_window", False):
            return (None,) * layers
        first = c.whole("max_window_layers", layers)
        return tuple(window if i >= first else None for i in range(layers))
    if model_type == "gemma":
        return (None,) * layers
    return (window,) * layers


# GGUF architectures whose sliding window applies to alternate layers (llama.cpp's llama-model.cpp).
_GGUF_SWA_EVERY = {"gemma2": 2, "gemma3": 6}


def kv_shape_from_header(shape: HeaderShape) -> KVShape | None:
    """The KV cache shape a GGUF header gives, or None when it lacks layers or heads."""
    if not shape.layers:
        return None
    if shape.kv_lora_rank and shape.rope_dimensions:
        return KVShape.latent(shape.layers, shape.kv_lora_rank + shape.rope_dimensions)
    if not shape.heads or not (shape.key_length or shape.embedding):
        return None
    head_dim = shape.key_length or (shape.embedding or 0) // shape.heads
    per_layer = shape.kv_heads_per_layer or (shape.kv_heads or shape.heads,) * shape.layers
    if len(per_layer) != shape.layers:
        return None
    every = _GGUF_SWA_EVERY.get(shape.architecture or "")
    windows = tuple(
        shape.sliding_window if shape.sliding_window and (every is None or (i + 1) % every) else None
        for i in range(shape.layers)
    )
    return KVShape(tuple(per_layer), head_dim, shape.value_length or head_dim, windows)


@dataclass(frozen=True)
class EngineMemory:
    """What an engine takes of a GPU besides weights and KV cache, and how much of the GPU it may use.

    `memory_fraction` is the engine's default share of each GPU; the
    overheads are the parts it counts inside that share.
    """

    engine: str
    memory_fraction: float
    cuda_context_bytes: int
    activation_bytes: int
    graph_bytes: int
    source: str

    @property
    def overhead_bytes(self) -> int:
        return self.cuda_context_bytes + self.activation_bytes + self.graph_bytes


# vLLM 0.32: CacheConfig.gpu_memory_utilization defaults to 0.92 (0.9 before). Inside it: memory outside torch
# (CUDA context, cuBLAS and NCCL workspaces; vLLM logs it as "non-torch memory", about 0.5 GiB on one GPU), the
# profiling pass's activation peak ("torch peak memory increase"; 2048-8192 batched tokens of a 7-70B model,
# about 1.5 GiB), and since VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 the CUDA graph estimate (about 0.5 GiB).
VLLM_MEMORY_FRACTION = 0.92
VLLM_CUDA_CONTEXT = 512 * MIB
VLLM_ACTIVATION_PEAK = 1536 * MIB
VLLM_CUDA_GRAPHS = 512 * MIB
# SGLang: mem_fraction_static covers weights and the KV pool only; ServerArgs picks it from GPU memory and TP
# (about 0.8-0.88) and leaves the rest for activations and CUDA graphs, so no overhead is counted inside it.
SGLANG_MEMORY_FRACTION = 0.85
# llama.cpp takes no share: it allocates weights, KV cache and compute buffers until the GPU is full. Its
# log's "CUDA0 compute buffer size" is a few hundred MiB at the default batch sizes; the CUDA context ~0.3 GiB.
LLAMACPP_CUDA_CONTEXT = 320 * MIB
LLAMACPP_COMPUTE_BUFFER = 512 * MIB

ENGINE_MEMORY: dict[str, EngineMemory] = {
    "vllm": EngineMemory(
        "vllm",
        VLLM_MEMORY_FRACTION,
        VLLM_CUDA_CONTEXT,
        VLLM_ACTIVATION_PEAK,
        VLLM_CUDA_GRAPHS,
        "vLLM gpu_worker.determine_available_memory",
    ),
    "sglang": EngineMemory("sglang", SGLANG_MEMORY_FRACTION, 0, 0, 0, "SGLang ServerArgs.mem_fraction_static"),
    "llamacpp": EngineMemory(
        "llamacpp", 1.0, LLAMACPP_CUDA_CONTEXT, LLAMACPP_COMPUTE_BUFFER, 0, "llama.cpp compute buffers"
    ),
    # The bundled mock engine stands in for vLLM, and is judged like it.
    "mock": EngineMemory(
        "mock", VLLM_MEMORY_FRACTION, VLLM_CUDA_CONTEXT, VLLM_ACTIVATION_PEAK, VLLM_CUDA_GRAPHS, "as vLLM"
    ),
}


class Fit(StrEnum):
    """Whether a profile's estimate fits its GPUs; `unknown` when the weights' size is not known."""

    FITS = "fits"
    DOES_NOT_FIT = "does_not_fit"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ProfileMemory:
    """What is known of one profile's memory: its weights, KV shape, served context and parallelism."""

    engine: str
    weights: WeightsEstimate
    kv: KVShape | None = None
    kv_dtype: str | None = None  # None: the weights' compute dtype (the engines' `auto`), else 16-bit
    max_model_len: int | None = None
    tensor_parallel: int = 1
    pipeline_stages: int = 1
    memory_fraction: float | None = None  # the profile's own (e.g. --gpu-memory-utilization), else the engine's


@dataclass(frozen=True)
class GPUMemory:
    """One GPU class and its memory (as agents report it)."""

    gpu_class: str
    memory_bytes: int


@dataclass(frozen=True)
class MemoryVerdict:
    """The answer for one profile on one GPU class, with the numbers behind it (bytes per GPU)."""

    fit: Fit
    sentence: str
    usable_bytes: int
    needs_bytes: int | None = None
    weights_bytes: int | None = None
    overhead_bytes: int | None = None
    kv_bytes: int | None = None  # one full-length sequence on one GPU; None = not counted
    sequences: int | None = None  # full-length sequences that fit beside the weights

    @property
    def needs_gib(self) -> float | None:
        return None if self.needs_bytes is None else round(self.needs_bytes / GIB, 1)

    @property
    def usable_gib(self) -> float:
        return round(self.usable_bytes / GIB, 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "fit": str(self.fit),
            "sentence": self.sentence,
            "needs_gib_per_gpu": self.needs_gib,
            "usable_gib_per_gpu": self.usable_gib,
            "weights_bytes_per_gpu": self.weights_bytes,
            "overhead_bytes_per_gpu": self.overhead_bytes,
            "kv_bytes_per_gpu": self.kv_bytes,
            "kv_counted": self.kv_bytes is not None,
            "full_length_sequences": self.sequences,
        }


def judge(profile: ProfileMemory, gpu: GPUMemory) -> MemoryVerdict:
    """Does `profile` fit on GPUs of class `gpu`? The rule of the module docstring, with its numbers."""
    if profile.engine not in ENGINE_MEMORY:
        raise ValueError(f"unknown engine {profile.engine!r}: one of {', '.join(sorted(ENGINE_MEMORY))}")
    if profile.tensor_parallel < 1 or profile.pipeline_stages < 1:
        raise ValueError("tensor-parallel size and pipeline stages must be at least 1")
    engine = ENGINE_MEMORY[profile.engine]
    fraction = profile.memory_fraction if profile.memory_fraction is not None else engine.memory_fraction
    if not 0 < fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {fraction}")
    usable = int(gpu.memory_bytes * fraction)
    has = f"{gpu.gpu_class} has {usable / GIB:.1f} GiB usable"
    if profile.weights.bytes is None:
        return MemoryVerdict(Fit.UNKNOWN, f"size unknown ({profile.weights.detail}); {has}", usable)
    weights = math.ceil(profile.weights.bytes / (profile.tensor_parallel * profile.pipeline_stages))
    kv, kv_note = _sequence_kv(profile, gpu)
    needs = weights + engine.overhead_bytes + (kv or 0)
    free_for_kv = usable - weights - engine.overhead_bytes
    sequences = None if not kv else max(0, free_for_kv // kv)
    fit = Fit.FITS if needs <= usable else Fit.DOES_NOT_FIT
    sentence = f"needs {needs / GIB:.1f} GiB per GPU; {has}"
    parts = f"weights {weights / GIB:.1f} + engine {engine.overhead_bytes / GIB:.1f}"
    sentence += f" ({parts} + {kv_note})" if kv is not None else f" ({parts}; {kv_note})"
    if sequences is not None and fit is Fit.FITS:
        sentence += f"; room for {sequences} full-length sequence{'' if sequences == 1 else 's'}"
    return MemoryVerdict(fit, sentence, usable, needs, weights, engine.overhead_bytes, kv, sequences)


def window_slack_tokens(engine: str, gpu: GPUMemory) -> int:
    """Tokens a sliding-window layer holds beyond its window for one sequence, as the engine reserves them.

    vLLM (SlidingWindowSpec.max_admission_blocks_per_request) keeps window − 1 +
    `max_in_flight_tokens`: two batches in flight under async scheduling, each of
    `max_num_batched_tokens`, whose API-server default follows the GPU (EngineArgs:
    16384 from 160 GiB, 8192 from 70 GiB except A100s, else 2048). llama.cpp's SWA
    cache keeps one micro-batch (512 tokens) beyond the window; SGLang's SWA pool
    is counted at the window.
    """
    if engine in ("vllm", "mock"):
        if gpu.memory_bytes >= 160 * GIB:
            batched = 16384
        elif gpu.memory_bytes >= 70 * GIB and "a100" not in gpu.gpu_class.lower():
            batched = 8192
        else:
            batched = 2048
        return 2 * batched
    return 512 if engine == "llamacpp" else 0


def _sequence_kv(profile: ProfileMemory, gpu: GPUMemory) -> tuple[int | None, str]:
    """KV bytes of one full-length sequence per GPU and how it reads, or None and why it is not counted."""
    if profile.kv is None:
        return None, "KV cache not counted: its shape is unknown"
    if not profile.max_model_len:
        return None, "KV cache not counted: the served context is unknown"
    try:
        bits = dtype_bits(profile.kv_dtype or profile.weights.compute_dtype or "bfloat16")
    except ValueError as exc:
        return None, f"KV cache not counted: {exc}"
    slack = window_slack_tokens(profile.engine, gpu)
    kv = profile.kv.sequence_bytes_per_gpu(
        profile.max_model_len, bits, profile.tensor_parallel, profile.pipeline_stages, slack
    )
    return kv, f"KV {kv / GIB:.1f} for one {profile.max_model_len}-token sequence"


def served_context(config: Mapping[str, Any] | None, max_model_len: int | None) -> int | None:
    """The context a profile serves: its own max_model_len, else the model's (engines default to it)."""
    if max_model_len:
        return max_model_len
    value = (config or {}).get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


@dataclass(frozen=True)
class MemoryArgs:
    """What a profile's engine args say that the memory model needs (None: the engine's default)."""

    memory_fraction: float | None = None
    max_model_len: int | None = None
    kv_dtype: str | None = None


# The flags each engine reads for its memory share, its context and its KV cache dtype. llama.cpp's
# --cache-type-k/-v may differ from each other and are not read: its KV cache is counted in f16.
_MEMORY_FLAGS: dict[str, dict[str, str]] = {
    "vllm": {"--gpu-memory-utilization": "fraction", "--max-model-len": "context", "--kv-cache-dtype": "kv"},
    "sglang": {"--mem-fraction-static": "fraction", "--context-length": "context", "--kv-cache-dtype": "kv"},
    "llamacpp": {"-c": "context", "--ctx-size": "context"},
}
_MEMORY_FLAGS["mock"] = _MEMORY_FLAGS["vllm"]


# The flag each engine takes for the context it serves, as a profile's max_model_len is passed (the mock has none).
CONTEXT_FLAG = {"vllm": "--max-model-len", "sglang": "--context-length", "llamacpp": "--ctx-size"}


def with_context(engine: str, args: list[str], max_model_len: int | None) -> list[str]:
    """`args` with the engine's context flag for `max_model_len` appended, unless the args already set the
    context (theirs wins) or the engine takes no such flag."""
    flag = CONTEXT_FLAG.get(engine)
    if not max_model_len or flag is None:
        return list(args)
    context_flags = [name for name, kind in _MEMORY_FLAGS.get(engine, {}).items() if kind == "context"]
    if any(arg.partition("=")[0] in context_flags for arg in args):
        return list(args)
    return [*args, flag, str(max_model_len)]


def memory_args(engine: str, args: list[str]) -> MemoryArgs:
    """Read a profile's engine args (`--flag value` or `--flag=value`); ValueError names a bad value."""
    flags = _MEMORY_FLAGS.get(engine, {})
    found: dict[str, Any] = {}
    for position, arg in enumerate(args):
        name, _, inline = arg.partition("=")
        if name not in flags:
            continue
        value = inline if inline else (args[position + 1] if position + 1 < len(args) else "")
        kind = flags[name]
        try:
            if kind == "fraction":
                found["memory_fraction"] = float(value)
                if not 0 < found["memory_fraction"] <= 1:
                    raise ValueError
            elif kind == "context":
                found["max_model_len"] = _context_tokens(value)
            elif value != "auto":
                dtype_bits(value)
                found["kv_dtype"] = value
        except ValueError:
            raise ValueError(f"engine arg {name}: {value!r} is not a valid value") from None
    return MemoryArgs(**found)


def _context_tokens(value: str) -> int | None:
    """vLLM's readable token counts: 8192, 32k (×1000), 32K (×1024), 1m, 1M; 0 = the model's own (llama.cpp)."""
    scale = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}.get(value[-1:], 1)
    number = value[:-1] if scale != 1 else value
    tokens = int(float(number) * scale) if scale != 1 else int(number)
    if tokens < 0:
        raise ValueError(value)
    return tokens or None


def parallel_shape(engine: str, gpus_per_node: int, nodes_per_replica: int) -> tuple[int, int]:
    """(tensor-parallel size, pipeline stages) of a profile as agent/engines.py starts it: vLLM runs tensor
    parallel within a node and one pipeline stage per node; SGLang tensor parallel over every GPU; llama.cpp
    splits layers over its GPUs (like stages)."""
    if engine == "sglang":
        return gpus_per_node * nodes_per_replica, 1
    if engine == "llamacpp":
        return 1, gpus_per_node * nodes_per_replica
    return gpus_per_node, nodes_per_replica
