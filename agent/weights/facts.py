"""What the weights an agent holds say of their own size and shape, for its weights reports.

For each source a scan finds (nodewire/weights/disk.py), the agent reads the weights'
headers (nodewire/weights/headers.py: the safetensors JSON header, GGUF metadata
and tensor infos; never a tensor) and, beside safetensors weights, the
model's `config.json`, and reports them as `WeightsHeaderFacts` so the control
plane can size a model whose source is a hub id it cannot read itself
(catalog/sizing.py).

Where: a GGUF source is its file; a hub repository's cache folder is read at
the snapshot `refs/main` names, else its newest snapshot. Reading is cheap but
not free (a sharded checkpoint has dozens of headers), so `HeaderCache` reads
each weights path once per modification stamp (the file's mtime and size, or
the snapshot folder's and its ref's mtimes) and keeps the answer, a failed
read included (a download in progress: the stamp changes when it completes).
It runs in the scan's thread, never on the heartbeat path.

A config.json's sliding window is reported only where the shape can say which
layers use it (every layer, or Gemma 2's alternation by its architecture);
per-layer patterns it cannot express (`layer_types`, Qwen's
`max_window_layers`) are left out, so the KV cache is counted in full: an
estimate on the safe side.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from nodewire.weights.header_types import HeaderShape, WeightsHeaderError
from nodewire.weights.headers import read_weights_headers
from nodewire.weights.messages import MAX_DTYPES, MAX_LAYERS, WeightsHeaderFacts, WeightsShape

log = logging.getLogger(__name__)

SNAPSHOTS = "snapshots"
MAIN_REF = os.path.join("refs", "main")
CONFIG_JSON = "config.json"
# Model types whose config.json window is not one window on every layer, and that the shape cannot express.
_PER_LAYER_WINDOWS = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma")
# Config keys of each shape fact, first present wins (the families name their expert count differently).
_CONFIG_KEYS = {
    "layers": ("num_hidden_layers",),
    "heads": ("num_attention_heads",),
    "kv_heads": ("num_key_value_heads",),
    "embedding": ("hidden_size",),
    "context_length": ("max_position_embeddings",),
    "key_length": ("head_dim",),
    "kv_lora_rank": ("kv_lora_rank",),
    "rope_dimensions": ("qk_rope_head_dim",),
    "experts": ("num_local_experts", "n_routed_experts", "num_experts"),
}


def weights_location(path: str) -> Path:
    """The file or folder whose headers describe the weights at `path` (a GGUF file, or a hub cache folder)."""
    folder = Path(path)
    if not folder.is_dir():
        return folder
    snapshots = folder / SNAPSHOTS
    try:
        revision = (folder / MAIN_REF).read_text().strip()
    except OSError:
        revision = ""
    if revision and "/" not in revision and (snapshots / revision).is_dir():
        return snapshots / revision
    candidates = [p for p in snapshots.iterdir() if p.is_dir()] if snapshots.is_dir() else []
    return max(candidates, key=lambda p: p.stat().st_mtime_ns) if candidates else folder


def header_facts(path: str) -> WeightsHeaderFacts | None:
    """What the headers of the weights at `path` say, or None when they cannot be read (WeightsHeaderError)."""
    location = weights_location(path)
    try:
        header = read_weights_headers(location)
    except (WeightsHeaderError, OSError) as exc:
        log.debug("no header facts for %s: %s", path, exc)
        return None
    if len(header.bytes_by_dtype) > MAX_DTYPES:
        return None  # not a checkpoint any engine loads; the protocol would refuse it
    shape = header.shape if header.format == "gguf" else config_shape(location / CONFIG_JSON)
    return WeightsHeaderFacts(
        format=header.format,
        tensor_bytes=header.total_bytes,
        parameters=header.elements,
        tensors=header.tensors,
        bytes_by_dtype=dict(header.bytes_by_dtype),
        shape=_reported_shape(shape),
    )


def config_shape(config_path: Path) -> HeaderShape | None:
    """The shape facts of a config.json (None if there is none, or it is not a JSON object)."""
    try:
        document = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict):
        return None
    text_config = document.get("text_config")
    config: dict[str, Any] = text_config if isinstance(text_config, dict) else document
    model_type = config.get("model_type")
    facts: dict[str, Any] = {name: _first_positive(config, keys) for name, keys in _CONFIG_KEYS.items()}
    window = _first_positive(config, ("sliding_window",))
    if "layer_types" in config or model_type in _PER_LAYER_WINDOWS:
        window = None
    return HeaderShape(
        architecture=model_type if isinstance(model_type, str) and 0 < len(model_type) <= 64 else None,
        sliding_window=window,
        **facts,
    )


def _first_positive(config: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = config.get(key)
        if type(value) is int and value > 0:
            return value
    return None


def _reported_shape(shape: HeaderShape | None) -> WeightsShape | None:
    if shape is None:
        return None
    per_layer = shape.kv_heads_per_layer
    facts = {k: v for k, v in vars(shape).items() if v is not None and k != "kv_heads_per_layer"}
    if per_layer is not None and len(per_layer) <= MAX_LAYERS and all(h >= 0 for h in per_layer):
        facts["kv_heads_per_layer"] = list(per_layer)
    if "architecture" in facts and len(facts["architecture"]) > 64:
        del facts["architecture"]
    return WeightsShape(**facts) if facts else None


def _stamp(path: str) -> tuple[Any, ...] | None:
    """What changes when the weights at `path` change: the file's mtime and size, or the snapshot's mtimes."""
    try:
        location = weights_location(path)
        stat = location.stat()
        ref = Path(path) / MAIN_REF
        return (str(location), stat.st_mtime_ns, stat.st_size, ref.stat().st_mtime_ns if ref.exists() else 0)
    except OSError:
        return None


class HeaderCache:
    """Header facts per weights path, read again only when the path's modification stamp changes."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple[Any, ...], WeightsHeaderFacts | None]] = {}
        self.reads = 0  # how many times headers were read (not answered from the cache)

    def facts(self, path: str) -> WeightsHeaderFacts | None:
        """The facts of the weights at `path` (blocking: call it from the scan's thread)."""
        stamp = _stamp(path)
        if stamp is None:
            return None
        known = self._known.get(path)
        if known is not None and known[0] == stamp:
            return known[1]
        self.reads += 1
        found = header_facts(path)
        self._known[path] = (stamp, found)
        return found

    def keep_only(self, paths: set[str]) -> None:
        """Forget the paths a scan no longer finds."""
        for gone in set(self._known) - paths:
            del self._known[gone]
