"""What a profile's engine args tell the memory model (its memory fraction, context and KV dtype), the flag
each engine takes for its context, and how each engine splits a replica over its GPUs (agent/engines.py)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from .parameters import dtype_bits


@dataclass(frozen=True)
class MemoryArgs:
    """What a profile's engine args say that the memory model needs (None: the engine's default)."""

    memory_fraction: float | None = None
    max_model_len: int | None = None
    kv_dtype: str | None = None


# The flags each engine reads for its memory share, its context and its KV cache dtype. llama.cpp's
# --cache-type-k/-v may differ from each other and are not read: its KV cache is counted in f16.
_MEMORY_FLAGS: dict[str, dict[str, str]] = {
    "vllm": {"--gpu-memory-utilization": "fraction", "--max-model-len": "context", "--kv-cache-dtype": "kv"},
    "sglang": {"--mem-fraction-static": "fraction", "--context-length": "context", "--kv-cache-dtype": "kv"},
    "llamacpp": {"-c": "context", "--ctx-size": "context"},
}
_MEMORY_FLAGS["mock"] = _MEMORY_FLAGS["vllm"]


# The flag each engine takes for the context it serves, as a profile's max_model_len is passed (the mock has none).
CONTEXT_FLAG = {"vllm": "--max-model-len", "sglang": "--context-length", "llamacpp": "--ctx-size"}


def sets_context(engine: str, args: list[str]) -> bool:
    """Whether `args` name the engine's context flag (to any value, the model's own included)."""
    context_flags = [name for name, kind in _MEMORY_FLAGS.get(engine, {}).items() if kind == "context"]
    return any(arg.partition("=")[0] in context_flags for arg in args)


def with_context(engine: str, args: list[str], max_model_len: int | None) -> list[str]:
    """`args` with the engine's context flag for `max_model_len` appended, unless the args already set the
    context (theirs wins) or the engine takes no such flag."""
    flag = CONTEXT_FLAG.get(engine)
    if not max_model_len or flag is None or sets_context(engine, args):
        return list(args)
    return [*args, flag, str(max_model_len)]


def memory_args(engine: str, args: list[str]) -> MemoryArgs:
    """Read a profile's engine args (`--flag value` or `--flag=value`); ValueError names a bad value."""
    found: dict[str, Any] = {}
    for name, kind, value, inline in _memory_flags(engine, args):
        try:
            found.update(_read(engine, kind, value, inline))
        except ValueError as exc:
            raise ValueError(_bad_value(name, value, exc)) from None
    return MemoryArgs(**found)


def context_problem(engine: str, args: list[str]) -> str | None:
    """Why the engine would refuse (or misread) the context `args` give it, naming the flag and the value; None
    if it takes it.

    Only the context is judged here: the memory model knows fewer KV cache dtypes than the engines do.
    """
    for name, kind, value, inline in _memory_flags(engine, args):
        if kind != "context":
            continue
        try:
            _read(engine, kind, value, inline)
        except ValueError as exc:
            return _bad_value(name, value, exc)
    return None


def _memory_flags(engine: str, args: list[str]) -> Iterator[tuple[str, str, str, bool]]:
    """(flag, kind, value, whether written `--flag=value`) for each flag of `args` the memory model reads."""
    flags = _MEMORY_FLAGS.get(engine, {})
    for position, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name not in flags:
            continue
        # `--flag=` gives the empty value (which the engines refuse), not the next argument.
        if not equals:
            value = args[position + 1] if position + 1 < len(args) else ""
        yield name, flags[name], value, bool(equals)


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
    if value == "auto":
        return {}
    dtype_bits(value)
    return {"kv_dtype": value}


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


def parallel_shape(engine: str, gpus_per_node: int, nodes_per_replica: int) -> tuple[int, int]:
    """(tensor-parallel size, pipeline stages) of a profile as agent/engines.py starts it: vLLM runs tensor
    parallel within a node and one pipeline stage per node; SGLang tensor parallel over every GPU; llama.cpp
    splits layers over its GPUs (like stages)."""
    if engine == "sglang":
        return gpus_per_node * nodes_per_replica, 1
    if engine == "llamacpp":
        return 1, gpus_per_node * nodes_per_replica
    return gpus_per_node, nodes_per_replica
