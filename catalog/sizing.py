"""A profile's memory estimate from the best source the control plane has, and its verdict on a GPU class.

Sources, best first (catalog/memory.py `estimate_weights` ranks them): a model
whose source is a local folder (or GGUF file) the control plane can read gives
its weights' headers and its `config.json`; else, for a source it cannot read
(a hub id, a GGUF path under the nodes' weights roots), the headers and shape
an agent reports with its weights on disk (`reported_weights`); else the
model's catalog size fields (`parameters_billions`, `dtype`, and `layers`,
`kv_heads`, `head_dim` for the KV cache). The served context is the engine
args' own flag, else the profile's `max_model_len`, else the model's
`max_position_embeddings` (or the context the reported shape gives).

What agents report lives in the inventory, above the catalog: the inventory
app registers its reader at start-up (`set_reported_weights`, as it does for
GPU memory). One read answers any number of sources, so a caller sizing many
profiles (the tick's memory check, a catalog's warnings) reads once and hands
the answer to `profile_memory`.

What a local source says is read once per (source, modification times) and
kept: a reconciler tick asks for every pending profile's estimate, and must not
read files each time (a stat of the folder and its config.json tells whether
anything changed).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from catalog.engine_flags import parallel_shape, read_memory_args, sets_context
from catalog.kv_cache import KVShape, kv_shape_from_config, kv_shape_from_header
from catalog.memory import MIB, Fit, GPUMemory, MemoryVerdict, ProfileMemory, estimate_weights, judge, served_context
from catalog.parameters import ConfigError
from nodewire.weights.disk import weights_key
from nodewire.weights.header_types import HeaderShape, WeightsHeader, WeightsHeaderError
from nodewire.weights.headers import read_weights_headers
from nodewire.weights.messages import WeightsHeaderFacts, WeightsShape

if TYPE_CHECKING:
    from catalog.models import Model, Profile

CONFIG_JSON = "config.json"


@dataclass(frozen=True)
class SourceFacts:
    """What a local model source says of itself: its weights' headers and config.json (None: not readable)."""

    header: WeightsHeader | None
    config: dict[str, Any] | None


_NOTHING = SourceFacts(None, None)
_cache: dict[str, tuple[tuple[int, ...], SourceFacts]] = {}
_lock = threading.Lock()


def _stamp(path: Path) -> tuple[int, ...] | None:
    """The modification times that say whether a local source changed; None if it is not a local path."""
    try:
        stamp = [path.stat().st_mtime_ns]
        if path.is_dir():
            config = path / CONFIG_JSON
            stamp.append(config.stat().st_mtime_ns if config.exists() else 0)
    except OSError:
        return None
    return tuple(stamp)


def source_facts(source: str) -> SourceFacts:
    """Headers and config.json of a local model source, read once per (source, modification times)."""
    path = Path(source)
    if not path.is_absolute():
        return _NOTHING  # a hub repository id: the control plane does not hold its files
    stamp = _stamp(path)
    if stamp is None:
        return _NOTHING
    with _lock:
        cached = _cache.get(source)
        if cached is not None and cached[0] == stamp:
            return cached[1]
    facts = SourceFacts(_read_header(path), _read_config(path))
    with _lock:
        _cache[source] = (stamp, facts)
    return facts


def _read_header(path: Path) -> WeightsHeader | None:
    try:
        return read_weights_headers(path)
    except (WeightsHeaderError, OSError):
        return None  # no weights here yet, or unreadable: the next source decides


def _read_config(path: Path) -> dict[str, Any] | None:
    config = path / CONFIG_JSON if path.is_dir() else None
    if config is None or not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _kv_shape(facts: SourceFacts, model: Model, reported: ReportedWeights | None) -> KVShape | None:
    if facts.config is not None:
        try:
            return kv_shape_from_config(facts.config)
        except ConfigError:
            pass
    for header in (facts.header, reported.header if reported is not None else None):
        if header is not None and header.shape is not None:
            shape = kv_shape_from_header(header.shape)
            if shape is not None:
                return shape
    if model.layers and model.kv_heads and model.head_dim:
        return KVShape.uniform(model.layers, model.kv_heads, model.head_dim)
    return None


def profile_memory(profile: Profile, reported: Mapping[str, ReportedWeights] | None = None) -> ProfileMemory:
    """What is known of `profile`'s memory, from the best source (module docstring).

    `reported` is what agents report, by weights key (`reported_weights`); without it, and when the model's
    source is not local, it is read for this one profile (one query).
    """
    model = profile.model
    facts = source_facts(model.source)
    key = weights_key(profile.engine, model.source)
    local = facts.header is not None or facts.config is not None
    if reported is None and not local:
        reported = reported_weights([key])
    node_says = None if local else (reported or {}).get(key)
    engine_args = list(profile.engine_args or [])
    # Each flag is read on its own: a bad value in one (which fails the engine's own start, with its own words)
    # leaves the others read, and the verdict names it.
    args, unread = read_memory_args(profile.engine, engine_args)
    weights = estimate_weights(
        header=facts.header,
        config=facts.config,
        parameters_billions=model.parameters_billions,
        dtype=model.dtype or None,
        engine=profile.engine,
        reported=node_says.header if node_says is not None else None,
        reported_by=node_says.node if node_says else "",
    )
    # Engine args that set the context win over the profile's max_model_len (with_context), "the model's own"
    # (vLLM's auto, llama.cpp's 0) included.
    profile_context = None if sets_context(profile.engine, engine_args) else profile.max_model_len
    context = args.max_model_len or served_context(facts.config, profile_context)
    if context is None and node_says is not None and node_says.header.shape is not None:
        context = node_says.header.shape.context_length
    tensor_parallel, stages = parallel_shape(profile.engine, profile.gpus_per_node, profile.nodes_per_replica)
    return ProfileMemory(
        engine=profile.engine,
        weights=weights,
        kv=_kv_shape(facts, model, node_says),
        kv_dtype=args.kv_dtype,
        max_model_len=context,
        tensor_parallel=tensor_parallel,
        pipeline_stages=stages,
        memory_fraction=args.memory_fraction,
        unread_args=tuple(unread),
    )


def verdict(
    profile: Profile, gpu_class: str, memory_mib: int, reported: Mapping[str, ReportedWeights] | None = None
) -> MemoryVerdict:
    """`profile` judged on GPUs of `gpu_class` with `memory_mib` MiB each (as agents report memory)."""
    return judge(profile_memory(profile, reported), GPUMemory(gpu_class, memory_mib * MIB))


def forget_sources() -> None:
    """Drop what was read of local sources (tests that rewrite a folder within one modification tick)."""
    with _lock:
        _cache.clear()


# GPU memory per class (MiB per GPU) as the fleet reports it. The catalog sits below the inventory, so the
# inventory app registers its reader of the agents' GPU rows at start-up (inventory.apps); until then, and for a
# class no agent reports, a class named with its size ("L40S-48GB") is taken at that size.
FleetMemory = Callable[[], dict[str, int]]
_fleet_memory: list[FleetMemory] = [dict]
_NAMED_SIZE = re.compile(r"-(\d+)GB$", re.IGNORECASE)


def set_fleet_memory(reader: FleetMemory) -> None:
    """Register where GPU memory per class comes from (the inventory app's reader of agents' GPU rows)."""
    _fleet_memory[0] = reader


def fleet_memory() -> dict[str, int]:
    """MiB per GPU of each reported GPU class (the largest reported for the class). One query."""
    return _fleet_memory[0]()


def class_memory_mib(gpu_class: str, fleet: dict[str, int]) -> int | None:
    """MiB per GPU of `gpu_class`: as reported, else the size in its name, else None (unknown)."""
    if fleet.get(gpu_class):
        return fleet[gpu_class]
    named = _NAMED_SIZE.search(gpu_class)
    return int(named[1]) * 1024 if named else None


def profile_verdict(
    profile: Profile, fleet: dict[str, int], reported: Mapping[str, ReportedWeights] | None = None
) -> MemoryVerdict | None:
    """`profile` judged on its GPU class's memory; None when that memory is not known or the engine not sized."""
    memory = class_memory_mib(profile.gpu_class, fleet)
    if memory is None:
        return None
    try:
        return verdict(profile, profile.gpu_class, memory, reported)
    except ValueError:
        return None


def shape_words(profile: Profile) -> str:
    """A profile's GPUs in an operator's words: `H100-80GB×2`, or `2 nodes of H100-80GB×8`."""
    label = f"{profile.gpu_class}×{profile.gpus_per_node}"
    return f"{profile.nodes_per_replica} nodes of {label}" if profile.nodes_per_replica > 1 else label


def verdict_lines(
    profiles: Iterable[Profile], fleet: dict[str, int], *, numbered: bool = True
) -> list[tuple[MemoryVerdict | None, str]]:
    """Each profile's verdict and a line for it: `profiles[0] H100-80GB×2: fits: needs ...` (a model's profiles
    in order), or without `numbered` its model's name in place of the position (one profile on its own)."""
    profiles = list(profiles)
    reported = reported_weights({weights_key(p.engine, p.model.source) for p in profiles})
    lines = []
    for i, profile in enumerate(profiles):
        judged = profile_verdict(profile, fleet, reported)
        words = (
            f"{judged.fit}: {judged.sentence}"
            if judged is not None
            else f"no verdict: the memory of GPU class {profile.gpu_class} is not known (no agent reports it)"
        )
        where = f"profiles[{i}]" if numbered else profile.model.name
        lines.append((judged, f"{where} {shape_words(profile)}: {words}"))
    return lines


def fit_warnings(profiles: Iterable[Profile], fleet: dict[str, int], *, numbered: bool = True) -> list[str]:
    """A warning per profile whose estimate does not fit its GPU class: placement will refuse it (the numbers
    say why). Warnings, not refusals: the estimate may be off, the fleet may change."""
    return [
        f"{line} (placement will not put it there)"
        for judged, line in verdict_lines(profiles, fleet, numbered=numbered)
        if judged is not None and judged.fit is Fit.DOES_NOT_FIT
    ]


@dataclass(frozen=True)
class ReportedWeights:
    """A source's weights as a node reports their headers (exact bytes, dtypes, shape), and which node."""

    header: WeightsHeader
    node: str


# What agents report of their weights' headers, by weights key (nodewire.weights.disk.weights_key). The inventory app
# registers its reader (one query for any number of keys); until then nothing is reported.
ReportedReader = Callable[[Collection[str]], dict[str, ReportedWeights]]
_reported_weights: list[ReportedReader] = [lambda keys: {}]


def set_reported_weights(reader: ReportedReader) -> None:
    """Register where agents' reported weights headers come from (the inventory app's reader of weights rows)."""
    _reported_weights[0] = reader


def reported_weights(keys: Collection[str]) -> dict[str, ReportedWeights]:
    """What agents report of the weights under `keys` (one query, whatever the number of keys)."""
    return _reported_weights[0](keys) if keys else {}


def reported_from_row(header: Any, node: str) -> ReportedWeights | None:
    """A stored weights report (the JSON of a WeightsHeaderFacts) as the memory model reads it; None if the
    JSON is not one (a row from another protocol version: that node's next report replaces it)."""
    try:
        return ReportedWeights(reported_header(msgspec.convert(header, WeightsHeaderFacts)), node)
    except msgspec.ValidationError:
        return None


def reported_header(facts: WeightsHeaderFacts) -> WeightsHeader:
    """A node's report of its weights' headers as the memory model reads headers (files: on the node)."""
    return WeightsHeader(
        format=facts.format,
        total_bytes=facts.tensor_bytes,
        elements=facts.parameters,
        tensors=facts.tensors,
        bytes_by_dtype=dict(facts.bytes_by_dtype),
        files=(),
        shape=None if facts.shape is None else _header_shape(facts.shape),
    )


def _header_shape(shape: WeightsShape) -> HeaderShape:
    values = {name: getattr(shape, name) for name in WeightsShape.__struct_fields__}
    per_layer = values.pop("kv_heads_per_layer")
    return HeaderShape(**values, kv_heads_per_layer=None if per_layer is None else tuple(per_layer))
