"""The facts read from a model's weight-file headers, shared by the safetensors and GGUF readers.

nodewire/weights/headers.py reads safetensors (and folders), nodewire/weights/gguf.py
reads GGUF (the first calls the second); both build the values here and use the
shard-set rule below, so the GGUF reader needs nothing of the safetensors one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})(?P<suffix>\.safetensors|\.gguf)$")


class WeightsHeaderError(ValueError):
    """A weights file whose header cannot be read: missing, truncated, not the format, or inconsistent."""


@dataclass(frozen=True)
class HeaderShape:
    """What a GGUF file's metadata says of the model's shape (None: the file does not say)."""

    architecture: str | None = None
    layers: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    kv_heads_per_layer: tuple[int, ...] | None = None
    embedding: int | None = None
    context_length: int | None = None
    key_length: int | None = None
    value_length: int | None = None
    kv_lora_rank: int | None = None
    rope_dimensions: int | None = None
    experts: int | None = None
    sliding_window: int | None = None


@dataclass(frozen=True)
class WeightsHeader:
    """The weights of one model as its headers describe them.

    `total_bytes` is what the tensors occupy in the files (and so in memory
    once loaded unconverted); `elements` counts tensor elements, which is the
    parameter count unless the file packs several weights per element
    (quantized checkpoints stored as int32).
    """

    format: Literal["safetensors", "gguf"]
    total_bytes: int
    elements: int
    tensors: int
    bytes_by_dtype: Mapping[str, int]
    files: tuple[str, ...]
    shape: HeaderShape | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A plain dict (for an agent report or a `--json` answer)."""
        shape = None if self.shape is None else {k: v for k, v in vars(self.shape).items() if v is not None}
        return {
            "format": self.format,
            "total_bytes": self.total_bytes,
            "elements": self.elements,
            "tensors": self.tensors,
            "bytes_by_dtype": dict(self.bytes_by_dtype),
            "files": list(self.files),
            "shape": shape,
        }


def shard_set(path: Path) -> list[Path]:
    """`path` and its sibling shards when its name is `STEM-0000k-of-0000n.EXT`, in order; else just `path`."""
    match = SHARD_NAME.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if count < 1 or int(match["part"]) > count:
        raise WeightsHeaderError(f"{path.name}: a shard number beyond its count")
    parts = [path.with_name(f"{match['stem']}-{k:05d}-of-{count:05d}{match['suffix']}") for k in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise WeightsHeaderError(f"{path.parent}: shard {missing[0]} is missing ({len(missing)} of {count})")
    return parts


def merge_headers(fmt: Literal["safetensors", "gguf"], parts: list[WeightsHeader]) -> WeightsHeader:
    by_dtype: dict[str, int] = {}
    for part in parts:
        for dtype, size in part.bytes_by_dtype.items():
            by_dtype[dtype] = by_dtype.get(dtype, 0) + size
    return WeightsHeader(
        format=fmt,
        total_bytes=sum(p.total_bytes for p in parts),
        elements=sum(p.elements for p in parts),
        tensors=sum(p.tensors for p in parts),
        bytes_by_dtype=by_dtype,
        files=tuple(f for p in parts for f in p.files),
        shape=parts[0].shape,
        metadata=parts[0].metadata,
    )


def product(values: Iterable[int]) -> int:
    result = 1
    for v in values:
        result *= v
    return result
