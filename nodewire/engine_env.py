"""A profile's engine environment: which variables a shard's engine may be given, and which values are secret.

One rule, checked on both ends with the same sentences: the catalog refuses a
profile whose `env` breaks it (`catalog.models`), and the agent's gate refuses
a start_shard carrying such an env (`nodewire.protocol`). The values of names that
look like credentials (ending in KEY, TOKEN, SECRET or PASSWORD, in any case)
are shown as MASK wherever an environment is shown: the agent's log, admin, the
REST API and `catalog export`. Messages name variables, never their values.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Any

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_VARIABLES = 64
MAX_NAME_LENGTH = 128
MAX_VALUE_LENGTH = 8192
MASK = "***"
SECRET_SUFFIXES = ("KEY", "TOKEN", "SECRET", "PASSWORD")

# The memory (MiB) of each GPU placed for a shard, comma-separated in CUDA_VISIBLE_DEVICES order: set by the agent.
GPU_MEMORY_ENV = "LLMGW_GPU_MEMORY_MIB"
# vLLM serves its sleep routes (and its other development routes) only with this set; the mock engine too.
VLLM_DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
# vLLM serves its adapter load and unload routes only with this set; the mock engine too.
VLLM_RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

# What the agent sets for every engine itself, after the profile's env: a profile setting one would
# only appear to change it, so it is refused with the reason.
RESERVED = {
    "CUDA_VISIBLE_DEVICES": "the agent sets it to the GPUs placed for each shard",
    "HF_HOME": "the agent sets it to the node's weights root (--weights-root), where it finds the weights it "
    "reports; without one, engines inherit the agent's own HF_HOME",
    GPU_MEMORY_ENV: "the agent sets it to the memory (MiB) of each GPU placed for the shard, so an engine "
    "(the mock's --memory-gib-per-gpu) can tell whether it fits",
    "VLLM_HOST_IP": "the agent sets it on every vLLM rank to that rank's own node address; one value for every "
    "node of a profile would be wrong on all but one",
}

_KINDS = ((bool, "true or false"), (int | float, "a number"), (list, "a list"), (dict, "a mapping"))


def is_secret(name: str) -> bool:
    """Whether a variable's value is masked wherever it is shown: its name ends in KEY, TOKEN, SECRET or PASSWORD."""
    return name.upper().endswith(SECRET_SUFFIXES)


def masked(env: Mapping[str, str]) -> dict[str, str]:
    """`env` as it may be shown: the value of every secret name replaced by MASK."""
    return {name: MASK if is_secret(name) else value for name, value in env.items()}


def shown(env: Mapping[str, str]) -> str:
    """`env` masked, as shell assignments (`A=1 HF_TOKEN=***`), for a log line or a table cell."""
    return " ".join(f"{name}={shlex.quote(value)}" for name, value in masked(env).items())


def env_problem(env: Any) -> str | None:
    """Why `env` is not an engine environment, naming the variable (never its value); None if it is one."""
    if not isinstance(env, dict):
        what = "null" if env is None else _kind(env)
        return (
            f'Engine env must be a mapping of variable names to strings, e.g. {{"OMP_NUM_THREADS": "8"}}; not {what}.'
        )
    if len(env) > MAX_VARIABLES:
        return f"Engine env has {len(env)} variables; at most {MAX_VARIABLES}."
    for name, value in env.items():
        problem = _name_problem(name) or _value_problem(name, value)
        if problem is not None:
            return problem
    return None


def _name_problem(name: Any) -> str | None:
    if not isinstance(name, str):
        return f"Variable name {name!r} is not a string."
    if len(name) > MAX_NAME_LENGTH:
        return f"Variable name “{name[:40]}…” is {len(name)} characters long; at most {MAX_NAME_LENGTH}."
    if not NAME.fullmatch(name):
        return f"Variable name {name!r} is not valid: use letters, digits and _, not starting with a digit."
    if name in RESERVED:
        return f"Variable {name} cannot be set on a profile: {RESERVED[name]}."
    return None


def _value_problem(name: str, value: Any) -> str | None:
    if not isinstance(value, str):
        return f'Variable {name}: the value must be a string, not {_kind(value)} (in YAML, quote it: "1").'
    if "\x00" in value:
        return f"Variable {name}: the value holds a NUL character, which no environment can carry."
    if len(value) > MAX_VALUE_LENGTH:
        return f"Variable {name}: the value is {len(value)} characters long; at most {MAX_VALUE_LENGTH}."
    return None


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return next((name for kind, name in _KINDS if isinstance(value, kind)), f"a {type(value).__name__}")
