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

1. the weights' own headers (nodewire/weights/headers.py): exact file bytes;
2. a model folder's `config.json`: parameters counted from the architecture
   (`parameter_count`) × the dtype (`torch_dtype`, or `quantization_config`:
   AWQ/GPTQ pack linear weights at `bits` plus a 16-bit scale and a `bits`
   zero point per group; FP8 at one byte; bitsandbytes 4/8-bit);
3. the headers as a node reports them (the weights of a hub id the control
   plane cannot read; exact too, counted as 1 is);
4. the operator's catalog fields `parameters_billions` and `dtype`.
The verdict's sentence ends with where the size came from.
vLLM and SGLang serve a float32 checkpoint in bfloat16 (their `--dtype auto`),
so its float32 tensors count half their file bytes there; the KV cache takes
the dtype the engine computes in unless the profile names one (`--kv-cache-dtype`).
Nothing known, or a quantization the model does not know, is "unknown": no
verdict, never a guess presented as a fact.

Parameter counts: catalog/parameters.py. KV cache per token: catalog/kv_cache.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from typing import Any, Literal

from catalog.engine_flags import kv_cache_bits
from catalog.kv_cache import KVShape
from catalog.parameters import DTYPE_BITS, ConfigError, bytes_of, dtype_bits, parameter_count
from nodewire.weights.header_types import WeightsHeader

GIB = 1 << 30
MIB = 1 << 20

# vLLM and SGLang serve a float32 checkpoint in 16 bits (`--dtype auto`: vLLM's model config picks bfloat16,
# float16 where the device lacks it; vLLM 0.32 logs dtype=torch.bfloat16 for a float32 model and casts each
# tensor as it loads). llama.cpp holds GGUF tensors as stored.
HALVES_FLOAT32 = frozenset({"vllm", "sglang", "mock"})
SAFETENSORS_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclass(frozen=True)
class WeightsEstimate:
    """The weights' bytes and where the figure comes from; `bytes` None = unknown, `detail` says why."""

    bytes: int | None
    source: Literal["headers", "reported", "config", "catalog", "unknown"]
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
        return bytes_of(count.total * base)
    linear_bits = _quantized_linear_bits(quantization)
    return bytes_of(count.linear * linear_bits + (count.total - count.linear) * base)


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


def estimate_weights(
    *,
    header: WeightsHeader | None = None,
    config: Mapping[str, Any] | None = None,
    parameters_billions: float | None = None,
    dtype: str | None = None,
    engine: str | None = None,
    reported: WeightsHeader | None = None,
    reported_by: str = "",
) -> WeightsEstimate:
    """The weights' bytes as `engine` holds them, from the best source given: headers the control plane
    reads, config.json, headers a node reports (`reported`, by node `reported_by`), catalog."""
    if header is not None:
        return _from_header(header, engine)
    problems = []
    if config is not None:
        try:
            return _from_config(config, engine)
        except ConfigError as exc:
            problems.append(str(exc))
    if reported is not None:
        return _from_header(reported, engine, f"{reported.format} headers as node {reported_by} reports them")
    if parameters_billions is not None and dtype:
        try:
            bits = dtype_bits(dtype)
        except ValueError as exc:
            problems.append(str(exc))
        else:
            parameters = round(parameters_billions * 1e9)
            detail = f"catalog: {parameters_billions} B parameters in {dtype}"
            compute = dtype if dtype.lower() in DTYPE_BITS and bits >= 16 else None
            return WeightsEstimate(bytes_of(parameters * bits), "catalog", detail, parameters, compute)
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


def _from_header(header: WeightsHeader, engine: str | None, reported: str = "") -> WeightsEstimate:
    """Bytes from headers: read here (`reported` empty), or as a node reports them (`reported` says which)."""
    detail = reported or f"{header.format} headers of {len(header.files)} file(s)"
    source: Literal["headers", "reported"] = "reported" if reported else "headers"
    if header.format == "gguf":  # llama.cpp holds GGUF tensors as stored and computes the KV cache in f16
        return WeightsEstimate(header.total_bytes, source, detail, header.elements, "float16")
    floats = {name: header.bytes_by_dtype.get(tag, 0) for tag, name in SAFETENSORS_FLOATS.items()}
    stored = max(floats, key=lambda name: floats[name]) if any(floats.values()) else None
    total = header.total_bytes
    if engine in HALVES_FLOAT32 and floats["float32"]:
        total -= floats["float32"] // 2
        detail += ", float32 served as bfloat16"
    return WeightsEstimate(total, source, detail, header.elements, stored and served_dtype(engine, stored))


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
    unread_args: tuple[str, ...] = ()  # engine args the estimate could not read (each counts as its default)


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
    size_source: str = "unknown"  # where the weights' size came from (WeightsEstimate.source)

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
            "size_source": self.size_source,
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
    # An engine arg not read counts as the engine's default; the verdict says which, as the engine would refuse it.
    unread = "".join(f"; {problem}, counted as the engine's default" for problem in profile.unread_args)
    if profile.weights.bytes is None:
        return MemoryVerdict(Fit.UNKNOWN, f"size unknown ({profile.weights.detail}); {has}{unread}", usable)
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
    sentence += f"; size from {profile.weights.detail}{unread}"
    return MemoryVerdict(
        fit, sentence, usable, needs, weights, engine.overhead_bytes, kv, sequences, profile.weights.source
    )


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
        if profile.kv_dtype:
            bits = kv_cache_bits(profile.engine, profile.kv_dtype, *profile.kv.slot_dims)
        else:
            bits = dtype_bits(profile.weights.compute_dtype or "bfloat16")
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
