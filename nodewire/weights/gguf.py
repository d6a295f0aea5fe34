"""A GGUF model's size and shape from its header: metadata and tensor infos, never a tensor.

Layout: magic, version, tensor and key/value counts, the key/value metadata,
then one info record per tensor (name, dimensions, ggml type, offset). A
tensor's bytes follow from its type's block size (a Q4_K block of 256 weights
takes 144 bytes); the type tables come from the `gguf` package. A split file
`NAME-0000k-of-0000n.gguf` is read with all its parts.

The walk is the project's own rather than `gguf.GGUFReader`: that reader
takes every length in the file on trust, and an array whose length points past
the end of the file makes it loop without end, growing a list. Here every
count and length is checked against the bytes that remain, so a truncated or
hostile file is a `WeightsHeaderError` naming the problem, never a hang or a
large read.
"""

from __future__ import annotations

import importlib
import mmap
import os
import struct
from collections.abc import Mapping
from fractions import Fraction
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from nodewire.weights.header_types import (
    HeaderShape,
    WeightsHeader,
    WeightsHeaderError,
    merge_headers,
    product,
    shard_set,
)

# ggml keeps at most four dimensions per tensor (GGML_MAX_DIMS).
GGUF_MAX_DIMS = 4


def read_gguf(path: str | os.PathLike[str]) -> WeightsHeader:
    """A GGUF model's header, all parts of a split file included (metadata from the first part)."""
    return merge_headers("gguf", [_read_gguf_file(p) for p in shard_set(Path(path))])


def _read_gguf_file(path: Path) -> WeightsHeader:
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise WeightsHeaderError(f"{path.name}: {size} bytes, too short for a GGUF header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                return _GGUFWalk(path.name, view).header(str(path))
    except OSError as exc:
        raise WeightsHeaderError(f"{path}: cannot read ({exc.strerror or exc})") from None


@cache
def _gguf() -> ModuleType:
    """The `gguf` package, imported on first use: it brings numpy, a sixth of a second that every control-plane
    process (each `manage.py` command) would pay at start-up though only a GGUF file needs it."""
    return importlib.import_module("gguf")


@cache
def _scalars() -> dict[int, tuple[str, int]]:
    """Fixed sizes of GGUF scalar value types; strings and arrays carry their own lengths."""
    kind = _gguf().GGUFValueType
    return {
        kind.UINT8: ("<B", 1),
        kind.INT8: ("<b", 1),
        kind.UINT16: ("<H", 2),
        kind.INT16: ("<h", 2),
        kind.UINT32: ("<I", 4),
        kind.INT32: ("<i", 4),
        kind.FLOAT32: ("<f", 4),
        kind.BOOL: ("<?", 1),
        kind.UINT64: ("<Q", 8),
        kind.INT64: ("<q", 8),
        kind.FLOAT64: ("<d", 8),
    }


# Integer arrays worth keeping (per-layer head counts); longer ones (token types) are skipped.
_GGUF_KEPT_ARRAY = 4096


class _GGUFWalk:
    """A bounded cursor over a GGUF file: every read is checked against the bytes left."""

    def __init__(self, name: str, view: mmap.mmap):
        self.name = name
        self.view = view
        self.pos = 0

    def take(self, n: int, what: str) -> int:
        """Advance over `n` bytes and return where they start."""
        if n < 0 or n > len(self.view) - self.pos:
            raise WeightsHeaderError(
                f"{self.name}: truncated or corrupt: {what} needs {n} bytes at {self.pos}, the file has {len(self.view)}"
            )
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, kind: int, what: str) -> Any:
        fmt, n = _scalars()[kind]
        return struct.unpack_from(fmt, self.view, self.take(n, what))[0]

    def string(self, what: str) -> str:
        n = self.scalar(_gguf().GGUFValueType.UINT64, what)
        start = self.take(n, what)
        try:
            return self.view[start : start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise WeightsHeaderError(f"{self.name}: {what} is not UTF-8") from None

    def count(self, what: str, least_bytes_each: int) -> int:
        """A count read from the file, refused when that many items could not fit in what is left."""
        n = self.scalar(_gguf().GGUFValueType.UINT64, what)
        if n * least_bytes_each > len(self.view) - self.pos:
            raise WeightsHeaderError(
                f"{self.name}: {what} {n} cannot fit in the {len(self.view) - self.pos} bytes left"
            )
        return n

    def value(self, kind: int, what: str) -> Any:
        if kind in _scalars():
            return self.scalar(kind, what)
        if kind == _gguf().GGUFValueType.STRING:
            return self.string(what)
        if kind != _gguf().GGUFValueType.ARRAY:
            raise WeightsHeaderError(f"{self.name}: {what} has unknown value type {kind}")
        item = self.scalar(_gguf().GGUFValueType.UINT32, what)
        least = _scalars()[item][1] if item in _scalars() else 8
        n = self.count(f"{what} length", least)
        if item in _scalars():
            if item == _gguf().GGUFValueType.FLOAT32 or n > _GGUF_KEPT_ARRAY:
                self.take(n * least, what)
                return None
            return tuple(self.scalar(item, what) for _ in range(n))
        for _ in range(n):  # skipped (a vocabulary, merges, scores), but every length still checked
            self.value(item, what)
        return None

    def header(self, path: str) -> WeightsHeader:
        if struct.unpack_from("<I", self.view, self.take(4, "magic"))[0] != _gguf().GGUF_MAGIC:
            raise WeightsHeaderError(f"{self.name}: not a GGUF file (no GGUF magic)")
        version = self.scalar(_gguf().GGUFValueType.UINT32, "version")
        if version not in (2, 3):
            raise WeightsHeaderError(f"{self.name}: GGUF version {version} is not supported (2 or 3)")
        tensor_count = self.count("tensor count", 8 + 4 + 8 + 4 + 8)
        metadata = {}
        for _ in range(self.count("key/value count", 8 + 4)):
            key = self.string("metadata key")
            metadata[key] = self.value(self.scalar(_gguf().GGUFValueType.UINT32, key), key)
        infos = [self.tensor_info() for _ in range(tensor_count)]
        alignment = metadata.get("general.alignment", _gguf().GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise WeightsHeaderError(f"{self.name}: general.alignment {alignment!r} is not a power of two")
        data_start = -(-self.pos // alignment) * alignment
        return self.summary(path, metadata, infos, data_start)

    def tensor_info(self) -> tuple[str, str, int, int, int]:
        """(name, ggml type name, elements, bytes, offset) of one tensor, its size from the type's blocks."""
        name = self.string("tensor name")
        n_dims = self.scalar(_gguf().GGUFValueType.UINT32, name)
        if not 1 <= n_dims <= GGUF_MAX_DIMS:
            raise WeightsHeaderError(f"{self.name}: tensor {name!r} has {n_dims} dimensions")
        dims = [self.scalar(_gguf().GGUFValueType.UINT64, name) for _ in range(n_dims)]
        raw_type = self.scalar(_gguf().GGUFValueType.UINT32, name)
        offset = self.scalar(_gguf().GGUFValueType.UINT64, name)
        try:
            ggml_type = _gguf().GGMLQuantizationType(raw_type)
            block, type_size = _gguf().GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise WeightsHeaderError(f"{self.name}: tensor {name!r} has unknown ggml type {raw_type}") from None
        if dims[0] % block:
            raise WeightsHeaderError(
                f"{self.name}: tensor {name!r} rows of {dims[0]} are not whole {ggml_type.name} blocks of {block}"
            )
        elements = product(dims)
        return name, ggml_type.name, elements, elements // block * type_size, offset

    def summary(
        self, path: str, metadata: dict[str, Any], infos: list[tuple[str, str, int, int, int]], data_start: int
    ) -> WeightsHeader:
        by_type: dict[str, int] = {}
        for name, type_name, _, nbytes, offset in infos:
            if data_start + offset + nbytes > len(self.view):
                raise WeightsHeaderError(f"{self.name}: truncated: tensor {name!r} ends past the end of the file")
            by_type[type_name] = by_type.get(type_name, 0) + nbytes
        return WeightsHeader(
            format="gguf",
            total_bytes=sum(by_type.values()),
            elements=sum(info[2] for info in infos),
            tensors=len(infos),
            bytes_by_dtype=by_type,
            files=(path,),
            shape=gguf_shape(metadata),
            metadata={k: v for k, v in metadata.items() if not isinstance(v, tuple)},
        )


def ggml_bits_per_weight(type_name: str) -> Fraction | None:
    """Bits per weight of a ggml type by name (Q4_K: 144 bytes per block of 256 = 4.5), None if not one."""
    try:
        block, type_size = _gguf().GGML_QUANT_SIZES[_gguf().GGMLQuantizationType[type_name.upper()]]
    except KeyError:
        return None
    return Fraction(type_size * 8, block)


def gguf_shape(metadata: Mapping[str, Any]) -> HeaderShape:
    """The model shape a GGUF file's metadata gives (`{arch}.block_count` and friends)."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        return HeaderShape()

    def number(key: str) -> int | None:
        value = metadata.get(key.format(arch=arch))
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    kv = metadata.get(_gguf().Keys.Attention.HEAD_COUNT_KV.format(arch=arch))
    per_layer = tuple(kv) if isinstance(kv, tuple) and all(isinstance(h, int) for h in kv) else None
    return HeaderShape(
        architecture=arch,
        layers=number(_gguf().Keys.LLM.BLOCK_COUNT),
        heads=number(_gguf().Keys.Attention.HEAD_COUNT),
        kv_heads=number(_gguf().Keys.Attention.HEAD_COUNT_KV) if per_layer is None else max(per_layer, default=None),
        kv_heads_per_layer=per_layer,
        embedding=number(_gguf().Keys.LLM.EMBEDDING_LENGTH),
        context_length=number(_gguf().Keys.LLM.CONTEXT_LENGTH),
        key_length=number(_gguf().Keys.Attention.KEY_LENGTH),
        value_length=number(_gguf().Keys.Attention.VALUE_LENGTH),
        kv_lora_rank=number(_gguf().Keys.Attention.KV_LORA_RANK),
        rope_dimensions=number(_gguf().Keys.Rope.DIMENSION_COUNT),
        experts=number(_gguf().Keys.LLM.EXPERT_COUNT),
        sliding_window=number(_gguf().Keys.Attention.SLIDING_WINDOW),
    )
