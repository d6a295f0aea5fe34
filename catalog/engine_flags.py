"""What a profile's engine args tell the memory model (its memory fraction, context and KV dtype), the flag
each engine takes for its context, and how each engine splits a replica over its GPUs (agent/engines.py)."""

from __future__ import annotations

from dataclasses import dataclass
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


def with_context(engine: str, args: list[str], max_model_len: int | None) -> list[str]:
    """`args` with the engine's context flag for `max_model_len` appended, unless the args already set the
    context (theirs wins) or the engine takes no such flag."""
    flag = CONTEXT_FLAG.get(engine)
    if not max_model_len or flag is None:
        return list(args)
    context_flags = [name for name, kind in _MEMORY_FLAGS.get(engine, {}).items() if kind == "context"]
    if any(arg.partition("=")[0] in context_flags for arg in args):
        return list(args)
    return [*args, flag, str(max_model_len)]


def memory_args(engine: str, args: list[str]) -> MemoryArgs:
    """Read a profile's engine args (`--flag value` or `--flag=value`); ValueError names a bad value."""
    flags = _MEMORY_FLAGS.get(engine, {})
    found: dict[str, Any] = {}
    for position, arg in enumerate(args):
        name, _, inline = arg.partition("=")
        if name not in flags:
            continue
        value = inline if inline else (args[position + 1] if position + 1 < len(args) else "")
        kind = flags[name]
        try:
            if kind == "fraction":
                found["memory_fraction"] = float(value)
                if not 0 < found["memory_fraction"] <= 1:
                    raise ValueError
            elif kind == "context":
                found["max_model_len"] = _context_tokens(value)
            elif value != "auto":
                dtype_bits(value)
                found["kv_dtype"] = value
        except ValueError:
            raise ValueError(f"engine arg {name}: {value!r} is not a valid value") from None
    return MemoryArgs(**found)


def _context_tokens(value: str) -> int | None:
    """vLLM's readable token counts: 8192, 32k (×1000), 32K (×1024), 1m, 1M; 0 = the model's own (llama.cpp)."""
    scale = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}.get(value[-1:], 1)
    number = value[:-1] if scale != 1 else value
    tokens = int(float(number) * scale) if scale != 1 else int(number)
    if tokens < 0:
        raise ValueError(value)
    return tokens or None


def parallel_shape(engine: str, gpus_per_node: int, nodes_per_replica: int) -> tuple[int, int]:
    """(tensor-parallel size, pipeline stages) of a profile as agent/engines.py starts it: vLLM runs tensor
    parallel within a node and one pipeline stage per node; SGLang tensor parallel over every GPU; llama.cpp
    splits layers over its GPUs (like stages)."""
    if engine == "sglang":
        return gpus_per_node * nodes_per_replica, 1
    if engine == "llamacpp":
        return 1, gpus_per_node * nodes_per_replica
    return gpus_per_node, nodes_per_replica
