"""What a profile's engine args tell the memory model (its memory fraction, context and KV dtype, with the
bytes each KV cache dtype stores), the flag each engine takes for its context, and how each engine splits a
replica over its GPUs (agent/engines/launch.py)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

from catalog.parameters import dtype_bits


@dataclass(frozen=True)
class MemoryArgs:
    """What a profile's engine args say that the memory model needs (None: the engine's default)."""

    memory_fraction: float | None = None
    max_model_len: int | None = None
    kv_dtype: str | None = None


# The flags each engine reads for its memory share, its context and its KV cache dtype, as each spells them
# (_flag_name for the spellings each also takes). vLLM registers --device-memory-utilization as an alias of
# --gpu-memory-utilization (vllm/engine/arg_utils.py:1356-1361). llama.cpp's --cache-type-k/-v may differ from
# each other and are not read: its KV cache is counted in f16.
_MEMORY_FLAGS: dict[str, dict[str, str]] = {
    "vllm": {
        "--gpu-memory-utilization": "fraction",
        "--device-memory-utilization": "fraction",
        "--max-model-len": "context",
        "--kv-cache-dtype": "kv",
    },
    "sglang": {"--mem-fraction-static": "fraction", "--context-length": "context", "--kv-cache-dtype": "kv"},
    "llamacpp": {"-c": "context", "--ctx-size": "context"},
}
_MEMORY_FLAGS["mock"] = _MEMORY_FLAGS["vllm"]


# The flag each engine takes for the context it serves, as a profile's max_model_len is passed (the mock has none).
CONTEXT_FLAG = {"vllm": "--max-model-len", "sglang": "--context-length", "llamacpp": "--ctx-size"}


def sets_context(engine: str, args: list[str]) -> bool:
    """Whether `args` name the engine's context flag (to any value, the model's own included), in any spelling
    the engine takes for it (vLLM's `--max_model_len`)."""
    flags = _MEMORY_FLAGS.get(engine, {})
    return any(flags.get(_flag_name(engine, arg)[0]) == "context" for arg in args)


def _flag_name(engine: str, arg: str) -> tuple[str, str, bool]:
    """(the flag `arg` names as the engine reads it, the value after `=`, whether there is an `=`).

    vLLM's FlexibleArgumentParser turns `_` into `-` in an argument starting with `--`, from there to the first
    `.` of the part before `=` (vllm/utils/argparse_utils.py:336-356): `--max_model_len=4096` is
    `--max-model-len=4096`. llama.cpp turns every `_` of an argument starting with `--` into `-`
    (common/arg.cpp:819-825, both parsers). SGLang's plain argparse takes only the spelling it registers.
    """
    name, equals, value = arg.partition("=")
    if name.startswith("--") and engine in ("vllm", "mock"):
        head, dot, tail = name.partition(".")
        name = head.replace("_", "-") + dot + tail
    elif name.startswith("--") and engine == "llamacpp":
        name = name.replace("_", "-")
    return name, value, bool(equals)


def _last_value(engine: str, args: list[str], flag: str) -> str | None:
    """The value `args` give `flag` (`--flag value` or `--flag=value`, in any spelling the engine takes); the
    last one given wins, as the engine's parser takes it."""
    found = None
    for i, arg in enumerate(args):
        name, value, inline = _flag_name(engine, arg)
        if name == flag:
            found = value if inline else (args[i + 1] if i + 1 < len(args) else None)
    return found


# The engines that order their own waiting requests by a request's `priority` field when started with
# `--scheduling-policy priority` (vLLM's SchedulerConfig.policy; the mock engine takes the same flag).
PRIORITY_ENGINES = ("vllm", "mock")


def schedules_by_priority(engine: str, args: list[str]) -> bool:
    """Whether `args` start the engine with priority scheduling (`--scheduling-policy priority`, in any spelling
    the engine takes; the last one given wins, as its parser takes it)."""
    if engine not in PRIORITY_ENGINES:
        return False
    return _last_value(engine, args, "--scheduling-policy") == "priority"


def pinned_revision(engine: str, args: list[str]) -> str | None:
    """The hub revision (branch, tag or commit) `args` pin the model's weights to (`--revision`, which vLLM and
    SGLang both take; the last one given wins), or None: the default branch. Staging fetches that revision."""
    if engine not in ("vllm", "sglang", "mock"):
        return None
    return _last_value(engine, args, "--revision") or None


# The flag each engine takes for the requests it runs at once, as a profile's max_concurrency is passed. llama.cpp's
# --parallel is left to the engine args: it splits the context between its slots, so it changes what each may hold.
BATCH_FLAG = {"vllm": "--max-num-seqs", "sglang": "--max-running-requests", "mock": "--max-num-seqs"}


def with_batch(engine: str, args: list[str], max_concurrency: int | None) -> list[str]:
    """`args` with the engine's batch flag for `max_concurrency` appended, unless the args already set it (theirs
    wins, in any spelling the engine takes) or the engine takes no such flag."""
    flag = BATCH_FLAG.get(engine)
    if not max_concurrency or flag is None or any(_flag_name(engine, arg)[0] == flag for arg in args):
        return list(args)
    return [*args, flag, str(max_concurrency)]


def with_context(engine: str, args: list[str], max_model_len: int | None) -> list[str]:
    """`args` with the engine's context flag for `max_model_len` appended, unless the args already set the
    context (theirs wins) or the engine takes no such flag."""
    flag = CONTEXT_FLAG.get(engine)
    if not max_model_len or flag is None or sets_context(engine, args):
        return list(args)
    return [*args, flag, str(max_model_len)]


def memory_args(engine: str, args: list[str]) -> MemoryArgs:
    """Read a profile's engine args (`--flag value` or `--flag=value`); ValueError names the first bad value."""
    found, problems = read_memory_args(engine, args)
    if problems:
        raise ValueError(problems[0])
    return found


def read_memory_args(engine: str, args: list[str]) -> tuple[MemoryArgs, list[str]]:
    """What each flag of `args` says, each read on its own, and why each one not read was not (naming it): a
    bad KV cache dtype leaves the memory fraction and the context read. A flag given twice reads as its last,
    as the engines' parsers take it."""
    found: dict[str, Any] = {}
    problems = []
    for name, kind, value, inline in _memory_flags(engine, args):
        try:
            found.update(_read(engine, kind, value, inline))
        except ValueError as exc:
            problems.append(_bad_value(name, value, exc))
    return MemoryArgs(**found), problems


def refused_value(engine: str, args: list[str]) -> str | None:
    """Why the engine would refuse (or misread) the context or the KV cache dtype `args` give it, naming the
    flag and the value; None if it takes them.

    The memory fraction is not judged here: the memory model's range for it is its own, not the engines'.
    """
    for name, kind, value, inline in _memory_flags(engine, args):
        if kind == "fraction":
            continue
        try:
            _read(engine, kind, value, inline)
        except ValueError as exc:
            return _bad_value(name, value, exc)
    return None


def _memory_flags(engine: str, args: list[str]) -> Iterator[tuple[str, str, str, bool]]:
    """(flag as written, kind, value, whether written `--flag=value`) for each flag of `args` the memory model
    reads, in any spelling the engine takes for it."""
    flags = _MEMORY_FLAGS.get(engine, {})
    for position, arg in enumerate(args):
        name, value, equals = _flag_name(engine, arg)
        if name not in flags:
            continue
        # `--flag=` gives the empty value (which the engines refuse), not the next argument.
        if not equals:
            value = args[position + 1] if position + 1 < len(args) else ""
        yield arg.partition("=")[0], flags[name], value, equals


def _read(engine: str, kind: str, value: str, inline: bool) -> dict[str, Any]:
    """The MemoryArgs field one flag's value gives, or a ValueError (its message says why, when there is more
    to say than that the value is not one)."""
    if inline and engine == "llamacpp":
        # Its parser looks the whole argument up as a flag name (common/arg.cpp), so the start fails.
        raise ValueError("llama.cpp takes no --flag=value: give the value as the next argument")
    if kind == "fraction":
        fraction = float(value)
        if not 0 < fraction <= 1:
            raise ValueError
        return {"memory_fraction": fraction}
    if kind == "context":
        return {"max_model_len": _CONTEXT_READERS[engine](value)}
    return {"kv_dtype": _kv_dtype(engine, value)}


def _bad_value(name: str, value: str, exc: ValueError) -> str:
    why = str(exc)
    return f"engine arg {name}: {value!r} is not a valid value" + (f" ({why})" if why else "")


# The context readers return the context in tokens, or None for the model's own context.
_SUFFIX_POWER = {"k": 1, "m": 2, "g": 3, "t": 4}
_VLLM_TOKENS = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_VLLM_TAKES = "vLLM takes tokens as 8192, 32k (x1000), 32K (x1024, whole numbers only), up to t/T, or auto"


def _vllm_context(value: str) -> int | None:
    """vLLM 0.32's --max-model-len (`human_readable_int_or_auto`, vllm/utils/argparse_utils.py): an int, or a
    number with k/m/g/t (powers of 1000; decimals allowed, truncated) or K/M/G/T (powers of 1024; whole numbers
    only). `auto` and -1 start from the model's own context (then shrunk to what fits the KV cache memory);
    ModelConfig refuses anything else below 1."""
    text = value.strip()
    if text.lower() == "auto":
        return None
    match = _VLLM_TOKENS.fullmatch(text)
    if match is None:
        tokens = _plain_int(text, _VLLM_TAKES)
    elif match[2].islower():
        tokens = int(float(match[1]) * 1000 ** _SUFFIX_POWER[match[2]])
    elif "." in match[1]:
        raise ValueError(f"vLLM allows no decimals with the binary suffix {match[2]}: try {match[1]}{match[2].lower()}")
    else:
        tokens = int(match[1]) * 1024 ** _SUFFIX_POWER[match[2].lower()]
    if tokens == -1:
        return None
    if tokens < 1:
        raise ValueError("vLLM needs at least 1 token; auto or -1 for the model's own context")
    return tokens


_SGLANG_TOKENS = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")
_SGLANG_TAKES = "SGLang takes tokens as 8192, 32k (x1000), 1M (x1000000) or 32Ki (x1024), case as written"


def _sglang_context(value: str) -> int:
    """SGLang 0.5.23's --context-length (`human_readable_int`, sglang/srt/utils/common.py): an int, or a number
    with the SI suffixes k/M/G/T (powers of 1000; decimals allowed, exact) or the IEC Ki/Mi/Gi/Ti (powers of
    1024; whole numbers only). Unlike vLLM, M is 10^6 and K or m are refused. It has no value for the model's
    own context (that is the flag left out), and serves no context below 1 token."""
    text = value.strip()
    match = _SGLANG_TOKENS.fullmatch(text)
    if match is None:
        tokens = _plain_int(text, _SGLANG_TAKES)
    elif len(match[2]) == 1:
        tokens = int(Decimal(match[1]) * 1000 ** _SUFFIX_POWER[match[2].lower()])
    elif "." in match[1]:
        raise ValueError(f"SGLang allows no decimals with the IEC suffix {match[2]}: try {match[1]}{match[2][0]}")
    else:
        tokens = int(match[1]) * 1024 ** _SUFFIX_POWER[match[2][0].lower()]
    if tokens < 1:
        raise ValueError("SGLang serves at least 1 token; leave the flag out for the model's own context")
    return tokens


# llama.cpp reads an int flag with std::stoi: the most a C int holds.
_C_INT_MAX = 2**31 - 1
_LLAMACPP_INT = re.compile(r"[+-]?[0-9]+")


def _llamacpp_context(value: str) -> int | None:
    """llama.cpp's -c/--ctx-size (common/arg.cpp): a plain int, 0 for the model's own context. It reads the
    value with std::stoi, which stops at the first non-digit (`32k` would be 32 tokens), so only a whole
    plain int is taken here."""
    text = value.strip()
    if not _LLAMACPP_INT.fullmatch(text):
        raise ValueError("llama.cpp takes a plain integer of tokens, and reads 32k as 32")
    tokens = int(text)
    if not 0 <= tokens <= _C_INT_MAX:
        raise ValueError(f"llama.cpp takes 0 (the model's own context) to {_C_INT_MAX}")
    return tokens or None


def _plain_int(text: str, takes: str) -> int:
    """`text` as Python's int() reads it (as both engines do), or a ValueError saying what `takes`."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(takes) from None


_CONTEXT_READERS: dict[str, Callable[[str], int | None]] = {
    "vllm": _vllm_context,
    "mock": _vllm_context,  # the mock engine takes vLLM's flags
    "sglang": _sglang_context,
    "llamacpp": _llamacpp_context,
}


# Bytes one token's K and V take in one head slot of `key_dim` + `value_dim` elements (an MLA latent: its
# `latent_dim`, 0), under each KV cache dtype an engine takes; None where the size cannot be known from the
# args (it depends on the model or the attention backend) or is the model's own (auto): the memory model then
# counts the model's dtype, the engines' `auto`, rather than guess low.
SlotBytes = Callable[[int, int], Fraction]


def _bits(bits: int | Fraction) -> SlotBytes:
    """A dtype of `bits` per element and nothing more."""
    return lambda key_dim, value_dim: Fraction(bits) * (key_dim + value_dim) / 8


def _per_token_head(bits: int) -> SlotBytes:
    """vLLM's *_per_token_head: the data, then one fp32 scale for K and one for V per token and head (Triton,
    vllm/v1/attention/backends/triton_attn.py:283-295; MLA one pair per latent, layers/attention/
    mla_attention.py:1576-1590)."""
    return lambda key_dim, value_dim: Fraction(bits) * (key_dim + value_dim) / 8 + 2 * 4


def _turboquant(key_bits: int, value_bits: int) -> SlotBytes:
    """vLLM's TurboQuant slot per token and head (TurboQuantConfig.slot_size_aligned, vllm/model_executor/
    layers/quantization/turboquant/config.py:128-176): FP8 keys (8 bits) or packed keys plus an fp16 norm, packed
    values plus an fp16 scale and zero, rounded up to even. Both are sized from the key's head size."""

    def slot(key_dim: int, value_dim: int) -> Fraction:
        key = key_dim if key_bits == 8 else math.ceil(key_dim * key_bits / 8) + 2
        both = key + math.ceil(key_dim * value_bits / 8) + 4
        return Fraction(both + both % 2)

    return slot


# vLLM 0.32 takes the CacheDType literal (vllm/config/cache.py:39-59) as argparse choices, case as written
# (literal_to_kwargs, vllm/engine/arg_utils.py:214-228); what each stores: vllm/utils/torch_utils.py:33-56.
_VLLM_KV: dict[str, SlotBytes | None] = {
    "auto": None,
    "float16": _bits(16),
    "bfloat16": _bits(16),
    "fp8": _bits(8),
    "fp8_e4m3": _bits(8),
    "fp8_e5m2": _bits(8),
    "fp8_inc": _bits(8),  # torch.float8_e4m3fn (Intel Gaudi)
    # DeepSeek sparse-MLA blobs per token, not per element: 656 or 352 bytes for V3.2's 576-wide latent
    # (mla_attention.py:1365), 584 under V4 (models/deepseek_v4/attention.py:878).
    "fp8_ds_mla": None,
    "nvfp4_ds_mla": None,
    "turboquant_k8v4": _turboquant(8, 4),
    "turboquant_4bit_nc": _turboquant(4, 4),
    "turboquant_k3v4_nc": _turboquant(3, 4),
    "turboquant_3bit_nc": _turboquant(3, 3),
    # FP4 codes with one UE8M0 byte per 32 (vllm/v1/attention/ops/ultraquant/format.py:159-205): 4.25 bits.
    "ultraquant_4bit": _bits(Fraction(17, 4)),
    "int4_per_token_head": _per_token_head(4),
    "int8_per_token_head": _per_token_head(8),
    "fp8_per_token_head": _per_token_head(8),
    # FP4 data plus an fp8 scale per 16 (nvfp4_kv_cache_full_dim, torch_utils.py:556-558; FlashInfer's
    # customize_spec, v1/attention/backends/flashinfer.py:436-445): 4.5 bits; 4over6 is the same layout.
    "nvfp4": _bits(Fraction(9, 2)),
    "nvfp4_4over6": _bits(Fraction(9, 2)),
}

# SGLang 0.5.23's --kv-cache-dtype choices (sglang/srt/arg_groups/fields/model.py:197-219); what each stores:
# configure_kv_cache_dtype (sglang/srt/mem_cache/kv_cache_dtype.py:35-87) and the pool's cell size
# (sglang/srt/model_executor/pool_configurator.py:340-530).
_SGLANG_KV: dict[str, SlotBytes | None] = {
    "auto": None,
    "bf16": _bits(16),
    "bfloat16": _bits(16),
    "fp8_e4m3": _bits(8),
    "fp8_e5m2": _bits(8),
    "mxfp8": _bits(Fraction(33, 4)),  # fp8 data plus one UE8M0 scale byte per 32 (pool_configurator.py:526-530)
    # FP4 data, then one or two scale layouts and a dequant workspace as the attention backend and the GPU
    # need them (layers/quantization/fp4_kv_cache_quant_method.py:744-768, 897-915): not known from the args.
    "nvfp4": None,
    "fp4_mx_block16": None,
}

_KV_DTYPES = {"vllm": _VLLM_KV, "mock": _VLLM_KV, "sglang": _SGLANG_KV}
_ENGINE_NAMES = {"vllm": "vLLM", "mock": "vLLM", "sglang": "SGLang"}


def _kv_dtype(engine: str, value: str) -> str | None:
    """The KV cache dtype the memory model counts for `--kv-cache-dtype value` (None: the model's dtype), or a
    ValueError naming the values the engine takes, when its parser would refuse `value`."""
    dtypes = _KV_DTYPES[engine]
    if value not in dtypes:
        raise ValueError(f"{_ENGINE_NAMES[engine]} takes {', '.join(dtypes)}, case as written")
    return None if dtypes[value] is None else value


def kv_cache_bits(engine: str, kv_dtype: str, key_dim: int, value_dim: int) -> Fraction:
    """Bits per element of a KV cache `kv_dtype` holds under `engine` in heads of `key_dim` + `value_dim` (an
    MLA latent: `latent_dim`, 0), its scales included; a dtype name the engine table lacks (a profile's
    memory set by hand) reads as parameters.dtype_bits does."""
    slot = _KV_DTYPES.get(engine, {}).get(kv_dtype)
    if slot is None:
        return dtype_bits(kv_dtype)
    return slot(key_dim, value_dim) * 8 / (key_dim + value_dim) if key_dim + value_dim else Fraction(0)


def parallel_shape(engine: str, gpus_per_node: int, nodes_per_replica: int) -> tuple[int, int]:
    """(tensor-parallel size, pipeline stages) of a profile as agent/engines/launch.py starts it: vLLM runs tensor
    parallel within a node and one pipeline stage per node; SGLang tensor parallel over every GPU; llama.cpp
    splits layers over its GPUs (like stages)."""
    if engine == "sglang":
        return gpus_per_node * nodes_per_replica, 1
    if engine == "llamacpp":
        return 1, gpus_per_node * nodes_per_replica
    return gpus_per_node, nodes_per_replica
