"""What a model's weight files say about themselves, read from their headers without reading a tensor.

For agents, of the weights they hold, and for the control plane, of a local
model folder; catalog/memory.py turns it into bytes per GPU. This module is
the one the control plane imports: it reads safetensors files and folders
here, GGUF files through nodewire/weights/gguf.py, and re-exports the shared
values (nodewire/weights/header_types.py).

* safetensors: an 8-byte little-endian header length, then that many bytes of
  JSON naming each tensor's dtype, shape and byte range in the data that
  follows. A sharded checkpoint is `model-0000k-of-0000n.safetensors` files
  listed by `model.safetensors.index.json` (its `weight_map`); every shard's
  header is read. Header lengths above safetensors' own limit (100 MB) are
  refused before anything is read.
* GGUF: metadata and tensor infos, every length checked (nodewire/weights/gguf.py).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from nodewire.weights.gguf import read_gguf
from nodewire.weights.header_types import (
    SHARD_NAME,
    WeightsHeader,
    WeightsHeaderError,
    merge_headers,
    product,
    shard_set,
)

__all__ = ["GGUF_SUFFIX", "SAFETENSORS_INDEX", "read_weights_headers"]

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


def read_weights_headers(path: str | os.PathLike[str]) -> WeightsHeader:
    """The weights at `path`: a `.safetensors` or `.gguf` file (with its other shards), or a model folder."""
    target = Path(path)
    if target.is_dir():
        return _read_folder(target)
    if not target.is_file():
        raise WeightsHeaderError(f"{target}: no such file or folder")
    if target.name.endswith(SAFETENSORS_SUFFIX):
        return merge_headers("safetensors", [_read_safetensors(p) for p in shard_set(target)])
    if target.name.endswith(GGUF_SUFFIX):
        return read_gguf(target)
    raise WeightsHeaderError(f"{target}: not a .safetensors or .gguf file")


def _read_folder(folder: Path) -> WeightsHeader:
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        return merge_headers("safetensors", [_read_safetensors(p) for p in _index_files(index)])
    shards = sorted(folder.glob("*" + SAFETENSORS_SUFFIX))
    if shards:
        return merge_headers("safetensors", [_read_safetensors(p) for p in shards])
    ggufs = sorted(p for p in folder.glob("*" + GGUF_SUFFIX) if _is_first_part(p))
    if len(ggufs) == 1:
        return read_gguf(ggufs[0])
    if ggufs:
        raise WeightsHeaderError(f"{folder}: {len(ggufs)} GGUF models in one folder; name the file")
    raise WeightsHeaderError(f"{folder}: no .safetensors or .gguf weights in the folder")


def _is_first_part(path: Path) -> bool:
    match = SHARD_NAME.match(path.name)
    return match is None or int(match["part"]) == 1


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
        count = product(shape)
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
