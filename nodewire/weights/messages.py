"""The weights part of the agent protocol: one source's weights on a node's disk, and what their headers say.

Items of `hello` and `heartbeat` (nodewire/protocol.py re-exports them; that
module is the protocol's one entry). `header` is optional: an agent that
predates it, or weights whose headers cannot be read (a download in progress,
a format not known), report none, and the control plane falls back to its
other sources of a model's size (catalog/sizing.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

Count = Annotated[int, Meta(ge=0)]
Positive = Annotated[int, Meta(ge=1)]
# Far above any real model (a few hundred layers, a few dozen dtypes): a bound, so a report stays small.
MAX_LAYERS = 4096
MAX_DTYPES = 64


class WeightsShape(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the weights say of the model's shape, for its KV cache and context (None: they do not say).

    From a GGUF file's metadata (`{arch}.block_count`, ...), or from the
    config.json beside safetensors weights (`num_hidden_layers`, ...);
    agent/weights/facts.py maps both to these names.
    """

    architecture: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    layers: Positive | None = None
    heads: Positive | None = None
    kv_heads: Positive | None = None
    kv_heads_per_layer: Annotated[list[Count], Meta(max_length=MAX_LAYERS)] | None = None
    embedding: Positive | None = None
    context_length: Positive | None = None
    key_length: Positive | None = None
    value_length: Positive | None = None
    kv_lora_rank: Positive | None = None
    rope_dimensions: Positive | None = None
    experts: Positive | None = None
    sliding_window: Positive | None = None


class WeightsHeaderFacts(Struct, frozen=True, kw_only=True):
    """The size of one source's weights as their headers give it: exact, not counted from the files on disk.

    `tensor_bytes` is what the tensors occupy (the sum of `bytes_by_dtype`, by
    safetensors dtype or ggml type name); `parameters` counts tensor elements.
    """

    format: Literal["safetensors", "gguf"]
    tensor_bytes: Count
    parameters: Count
    tensors: Count
    bytes_by_dtype: Annotated[
        dict[Annotated[str, Meta(min_length=1, max_length=32)], Count], Meta(max_length=MAX_DTYPES)
    ]
    shape: WeightsShape | None = None

    def __post_init__(self) -> None:
        total = sum(self.bytes_by_dtype.values())
        if total != self.tensor_bytes:
            raise ValueError(f"bytes_by_dtype adds up to {total}, not tensor_bytes {self.tensor_bytes}")


class WeightsReport(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One source's weights on the node's disk (nodewire/weights/disk.py says where each source lives)."""

    source: Annotated[str, Meta(min_length=1, max_length=500)]
    path: Annotated[str, Meta(min_length=1, max_length=1000)]
    size_bytes: Count
    # None: the agent does not say (an older agent, or headers it could not read); left out of the JSON then.
    header: WeightsHeaderFacts | None = None


def no_repeated_sources(weights: list[WeightsReport] | None) -> None:
    """ValueError naming the first source a weights list repeats."""
    seen: set[str] = set()
    for item in weights or ():
        if item.source in seen:
            raise ValueError(f"weights source {item.source!r} is repeated in `weights`")
        seen.add(item.source)
