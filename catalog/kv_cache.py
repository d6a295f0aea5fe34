"""The KV cache of a model: bytes per token and per full-length sequence on one GPU.

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
from fractions import Fraction
from typing import Any

from catalog.parameters import ConfigError, ConfigReader, bytes_of, family_of
from nodewire.weights.header_types import HeaderShape


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

    @property
    def slot_dims(self) -> tuple[int, int]:
        """(key, value) elements of one head's slot per token, as a KV cache dtype's scales are laid out: MLA's
        latent counts as the key (engine_flags.kv_cache_bits)."""
        return (self.latent_dim, 0) if self.latent_dim else (self.key_dim, self.value_dim)

    def layer_bytes_per_token(self, layer: int, kv_bits: Fraction | int, tensor_parallel: int = 1) -> Fraction:
        """Bytes one token takes in one layer's cache on one GPU of a tensor-parallel group."""
        if self.latent_dim:
            return Fraction(self.latent_dim * kv_bits, 8)  # one latent, whole on every rank
        heads = math.ceil(self.kv_heads[layer] / tensor_parallel)
        return Fraction(heads * (self.key_dim + self.value_dim) * kv_bits, 8)

    def bytes_per_token(self, kv_bits: Fraction | int) -> int:
        """KV bytes per token over all layers, windows aside (the figure engines log per token)."""
        return bytes_of(sum(self.layer_bytes_per_token(i, kv_bits) * 8 for i in range(self.layers)))

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
        return max((bytes_of(bits) for bits in stage_bits), default=0)


def kv_shape_from_config(config: Mapping[str, Any]) -> KVShape:
    """The KV cache shape a config.json describes (ConfigError if the family or a key is unknown)."""
    family = family_of(config)
    c = ConfigReader(config)
    layers = c.whole("num_hidden_layers")
    if family.mla:
        return KVShape.latent(layers, c.whole("kv_lora_rank") + c.whole("qk_rope_head_dim"))
    heads = c.whole("num_attention_heads")
    if heads == 0:
        raise ConfigError("config.json num_attention_heads must be at least 1")
    head_dim = c.whole("head_dim", c.whole("hidden_size") // heads)
    return KVShape.uniform(layers, c.whole("num_key_value_heads", heads), head_dim, windows=_config_windows(c, layers))


def _config_windows(c: ConfigReader, layers: int) -> tuple[int | None, ...]:
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
