"""What a model's weight files say about themselves, read from their headers without reading a tensor.

For agents, of the weights they hold, and for the control plane, of a local
model folder; catalog/memory.py turns it into bytes per GPU.

* safetensors: an 8-byte little-endian header length, then that many bytes of
  JSON naming each tensor's dtype, shape and byte range in the data that
  follows. A sharded checkpoint is `model-0000k-of-0000n.safetensors` files
  listed by `model.safetensors.index.json` (its `weight_map`); every shard's
  header is read. Header lengths above safetensors' own limit (100 MB) are
  refused before anything is read.
* GGUF: magic, version, tensor and key/value counts, the key/value metadata,
  then one info record per tensor (name, dimensions, ggml type, offset). A
  tensor's bytes follow from its type's block size (a Q4_K block of 256
  weights takes 144 bytes); the type tables come from the `gguf` package. A
  split file `NAME-0000k-of-0000n.gguf` is read with all its parts.

The GGUF walk is the project's own rather than `gguf.GGUFReader`: that reader
takes every length in the file on trust, and an array whose length points past
the end of the file makes it loop without end, growing a list. Here every
count and length is checked against the bytes that remain, so a truncated or
hostile file is a `WeightsHeaderError` naming the problem, never a hang or a
large read.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

import gguf

SAFETENSORS_SUFFIX = ".safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
GGUF_SUFFIX = ".gguf"
# safetensors refuses headers above this (safetensors' MAX_HEADER_SIZE); so do we, before reading one.
SAFETENSORS_MAX_HEADER = 100_000_000
# Bits per element of each safetensors dtype (F4 and F6 pack below a byte).
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "U16": 16,
    "I16": 16,
    "F16": 16,
    "BF16": 16,
    "U32": 32,
    "I32": 32,
    "F32": 32,
    "U64": 64,
    "I64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
# ggml keeps at most four dimensions per tensor (GGML_MAX_DIMS).
GGUF_MAX_DIMS = 4
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


def read_weights_headers(path: str | os.PathLike[str]) -> WeightsHeader:
    """The weights at `path`: a `.safetensors` or `.gguf` file (with its other shards), or a model folder."""
    target = Path(path)
    if target.is_dir():
        return _read_folder(target)
    if not target.is_file():
        raise WeightsHeaderError(f"{target}: no such file or folder")
    if target.name.endswith(SAFETENSORS_SUFFIX):
        return _merge("safetensors", [_read_safetensors(p) for p in _shard_set(target)])
    if target.name.endswith(GGUF_SUFFIX):
        return read_gguf(target)
    raise WeightsHeaderError(f"{target}: not a .safetensors or .gguf file")


def _read_folder(folder: Path) -> WeightsHeader:
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        return _merge("safetensors", [_read_safetensors(p) for p in _index_files(index)])
    shards = sorted(folder.glob("*" + SAFETENSORS_SUFFIX))
    if shards:
        return _merge("safetensors", [_read_safetensors(p) for p in shards])
    ggufs = sorted(p for p in folder.glob("*" + GGUF_SUFFIX) if _is_first_part(p))
    if len(ggufs) == 1:
        return read_gguf(ggufs[0])
    if ggufs:
        raise WeightsHeaderError(f"{folder}: {len(ggufs)} GGUF models in one folder; name the file")
    raise WeightsHeaderError(f"{folder}: no .safetensors or .gguf weights in the folder")


def _is_first_part(path: Path) -> bool:
    match = SHARD_NAME.match(path.name)
    return match is None or int(match["part"]) == 1


def _shard_set(path: Path) -> list[Path]:
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


def _index_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise WeightsHeaderError(f"{index}: not a safetensors index ({exc})") from None
    if not names or not all(isinstance(n, str) and "/" not in n and n.endswith(SAFETENSORS_SUFFIX) for n in names):
        raise WeightsHeaderError(f"{index}: its weight_map must name .safetensors files in the same folder")
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise WeightsHeaderError(f"{index.parent}: shard {missing[0]} named by the index is missing")
    return [index.parent / n for n in names]


def _merge(fmt: Literal["safetensors", "gguf"], parts: list[WeightsHeader]) -> WeightsHeader:
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


def _read_safetensors(path: Path) -> WeightsHeader:
    """One safetensors file's header: 8 bytes of length, then the JSON; the tensors are not read."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise WeightsHeaderError(f"{path.name}: {size} bytes, too short for a safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length > SAFETENSORS_MAX_HEADER:
                raise WeightsHeaderError(f"{path.name}: header length {length} is above safetensors' limit")
            if length > size - 8:
                raise WeightsHeaderError(f"{path.name}: header length {length} runs past the end ({size} bytes)")
            raw = f.read(length)
    except OSError as exc:
        raise WeightsHeaderError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise WeightsHeaderError(f"{path.name}: the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise WeightsHeaderError(f"{path.name}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    by_dtype, elements = _safetensors_tensors(path.name, header, size - 8 - length)
    return WeightsHeader(
        format="safetensors",
        total_bytes=sum(by_dtype.values()),
        elements=elements,
        tensors=len(header),
        bytes_by_dtype=by_dtype,
        files=(str(path),),
        metadata=metadata if isinstance(metadata, dict) else {},
    )


def _safetensors_tensors(name: str, header: dict[str, Any], data_size: int) -> tuple[dict[str, int], int]:
    """Bytes per dtype and element count of a header's tensors, each checked against the data it claims."""
    by_dtype: dict[str, int] = {}
    elements = 0
    for tensor, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise WeightsHeaderError(f"{name}: tensor {tensor!r} lacks dtype, shape or data_offsets") from None
        if not isinstance(dtype, str) or not _naturals(shape) or not _naturals((begin, end)):
            raise WeightsHeaderError(f"{name}: tensor {tensor!r} has a malformed dtype, shape or data_offsets")
        if not begin <= end <= data_size:
            raise WeightsHeaderError(f"{name}: tensor {tensor!r} lies outside the file's {data_size} data bytes")
        count = _product(shape)
        bits = SAFETENSORS_DTYPE_BITS.get(dtype)
        if bits is not None and end - begin != (count * bits + 7) // 8:
            raise WeightsHeaderError(
                f"{name}: tensor {tensor!r} holds {end - begin} bytes, its {dtype} shape needs {(count * bits + 7) // 8}"
            )
        by_dtype[dtype] = by_dtype.get(dtype, 0) + end - begin
        elements += count
    return by_dtype, elements


def _naturals(values: Any) -> bool:
    return isinstance(values, list | tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    )


def _product(values: Iterable[int]) -> int:
    result = 1
    for v in values:
        result *= v
    return result


def read_gguf(path: str | os.PathLike[str]) -> WeightsHeader:
    """A GGUF model's header, all parts of a split file included (metadata from the first part)."""
    return _merge("gguf", [_read_gguf_file(p) for p in _shard_set(Path(path))])


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


# Fixed sizes of GGUF scalar value types; strings and arrays carry their own lengths.
_GGUF_SCALARS: dict[int, tuple[str, int]] = {
    gguf.GGUFValueType.UINT8: ("<B", 1),
    gguf.GGUFValueType.INT8: ("<b", 1),
    gguf.GGUFValueType.UINT16: ("<H", 2),
    gguf.GGUFValueType.INT16: ("<h", 2),
    gguf.GGUFValueType.UINT32: ("<I", 4),
    gguf.GGUFValueType.INT32: ("<i", 4),
    gguf.GGUFValueType.FLOAT32: ("<f", 4),
    gguf.GGUFValueType.BOOL: ("<?", 1),
    gguf.GGUFValueType.UINT64: ("<Q", 8),
    gguf.GGUFValueType.INT64: ("<q", 8),
    gguf.GGUFValueType.FLOAT64: ("<d", 8),
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
        fmt, n = _GGUF_SCALARS[kind]
        return struct.unpack_from(fmt, self.view, self.take(n, what))[0]

    def string(self, what: str) -> str:
        n = self.scalar(gguf.GGUFValueType.UINT64, what)
        start = self.take(n, what)
        try:
            return self.view[start : start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise WeightsHeaderError(f"{self.name}: {what} is not UTF-8") from None

    def count(self, what: str, least_bytes_each: int) -> int:
        """A count read from the file, refused when that many items could not fit in what is left."""
        n = self.scalar(gguf.GGUFValueType.UINT64, what)
        if n * least_bytes_each > len(self.view) - self.pos:
            raise WeightsHeaderError(
                f"{self.name}: {what} {n} cannot fit in the {len(self.view) - self.pos} bytes left"
            )
        return n

    def value(self, kind: int, what: str) -> Any:
        if kind in _GGUF_SCALARS:
            return self.scalar(kind, what)
        if kind == gguf.GGUFValueType.STRING:
            return self.string(what)
        if kind != gguf.GGUFValueType.ARRAY:
            raise WeightsHeaderError(f"{self.name}: {what} has unknown value type {kind}")
        item = self.scalar(gguf.GGUFValueType.UINT32, what)
        least = _GGUF_SCALARS[item][1] if item in _GGUF_SCALARS else 8
        n = self.count(f"{what} length", least)
        if item in _GGUF_SCALARS:
            if item == gguf.GGUFValueType.FLOAT32 or n > _GGUF_KEPT_ARRAY:
                self.take(n * least, what)
                return None
            return tuple(self.scalar(item, what) for _ in range(n))
        for _ in range(n):  # skipped (a vocabulary, merges, scores), but every length still checked
            self.value(item, what)
        return None

    def header(self, path: str) -> WeightsHeader:
        if struct.unpack_from("<I", self.view, self.take(4, "magic"))[0] != gguf.GGUF_MAGIC:
            raise WeightsHeaderError(f"{self.name}: not a GGUF file (no GGUF magic)")
        version = self.scalar(gguf.GGUFValueType.UINT32, "version")
        if version not in (2, 3):
            raise WeightsHeaderError(f"{self.name}: GGUF version {version} is not supported (2 or 3)")
        tensor_count = self.count("tensor count", 8 + 4 + 8 + 4 + 8)
        metadata = {}
        for _ in range(self.count("key/value count", 8 + 4)):
            key = self.string("metadata key")
            metadata[key] = self.value(self.scalar(gguf.GGUFValueType.UINT32, key), key)
        infos = [self.tensor_info() for _ in range(tensor_count)]
        alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise WeightsHeaderError(f"{self.name}: general.alignment {alignment!r} is not a power of two")
        data_start = -(-self.pos // alignment) * alignment
        return self.summary(path, metadata, infos, data_start)

    def tensor_info(self) -> tuple[str, str, int, int, int]:
        """(name, ggml type name, elements, bytes, offset) of one tensor, its size from the type's blocks."""
        name = self.string("tensor name")
        n_dims = self.scalar(gguf.GGUFValueType.UINT32, name)
        if not 1 <= n_dims <= GGUF_MAX_DIMS:
            raise WeightsHeaderError(f"{self.name}: tensor {name!r} has {n_dims} dimensions")
        dims = [self.scalar(gguf.GGUFValueType.UINT64, name) for _ in range(n_dims)]
        raw_type = self.scalar(gguf.GGUFValueType.UINT32, name)
        offset = self.scalar(gguf.GGUFValueType.UINT64, name)
        try:
            ggml_type = gguf.GGMLQuantizationType(raw_type)
            block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise WeightsHeaderError(f"{self.name}: tensor {name!r} has unknown ggml type {raw_type}") from None
        if dims[0] % block:
            raise WeightsHeaderError(
                f"{self.name}: tensor {name!r} rows of {dims[0]} are not whole {ggml_type.name} blocks of {block}"
            )
        elements = _product(dims)
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
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name.upper()]]
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

    kv = metadata.get(gguf.Keys.Attention.HEAD_COUNT_KV.format(arch=arch))
    per_layer = tuple(kv) if isinstance(kv, tuple) and all(isinstance(h, int) for h in kv) else None
    return HeaderShape(
        architecture=arch,
        layers=number(gguf.Keys.LLM.BLOCK_COUNT),
        heads=number(gguf.Keys.Attention.HEAD_COUNT),
        kv_heads=number(gguf.Keys.Attention.HEAD_COUNT_KV) if per_layer is None else max(per_layer, default=None),
        kv_heads_per_layer=per_layer,
        embedding=number(gguf.Keys.LLM.EMBEDDING_LENGTH),
        context_length=number(gguf.Keys.LLM.CONTEXT_LENGTH),
        key_length=number(gguf.Keys.Attention.KEY_LENGTH),
        value_length=number(gguf.Keys.Attention.VALUE_LENGTH),
        kv_lora_rank=number(gguf.Keys.Attention.KV_LORA_RANK),
        rope_dimensions=number(gguf.Keys.Rope.DIMENSION_COUNT),
        experts=number(gguf.Keys.LLM.EXPERT_COUNT),
        sliding_window=number(gguf.Keys.Attention.SLIDING_WINDOW),
    )
