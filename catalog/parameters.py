"""What a checkpoint holds: its parameters, counted from its config.json, and the bits of each dtype.

Parameter counts are what the checkpoint holds: embeddings (once when tied to
the output head), attention projections with the family's biases, the gated
MLP (gate, up, down), routed and shared experts with their routers, and every
RMSNorm (two per layer; Gemma 2 four; DeepSeek's MLA adds its latent norms).
The families and their config keys follow Hugging Face `transformers`
(`modeling_llama`, `modeling_qwen2`, `modeling_mixtral`, `modeling_qwen2_moe`,
`modeling_gemma2`, `modeling_phi3`, `modeling_deepseek_v2`); DeepSeek-V3's
multi-token-prediction layers are not counted (engines do not load them unless
asked to speculate).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from nodewire.weights.gguf import ggml_bits_per_weight

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


def bytes_of(bits: Fraction | int) -> int:
    """Whole bytes that hold `bits`."""
    return math.ceil(Fraction(bits) / 8)


class ConfigError(ValueError):
    """A config.json the memory model cannot count: an unknown family or a missing or malformed key."""


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


class ConfigReader:
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
    c = ConfigReader(config)
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


def _attention(c: ConfigReader, family: Family, hidden: int) -> tuple[int, int]:
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


def _mla_attention(c: ConfigReader, hidden: int) -> tuple[int, int]:
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


def _mlp(c: ConfigReader, family: Family, hidden: int, layer: int) -> tuple[int, int]:
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
