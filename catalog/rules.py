"""Rules for catalog values that need no database: column ranges, name messages, a model's size, a
profile's engine args, env and sleep settings. The models (catalog/models.py) and every path that writes
them (admin, catalog files, REST) ask these same functions."""

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from django.core.validators import MaxValueValidator, MinValueValidator

from catalog.choices import ENGINE_SLEEP_LEVELS, Engine, SleepLevel
from catalog.engine_flags import refused_value
from nodewire.engine_env import MASK, env_problem, is_secret

# The column ranges PostgreSQL enforces, checked on every path (admin, catalog files, REST) and on
# SQLite too, whose integers are unbounded: a priority of 99999999 is refused, not saved.
SMALLINT_MAX = 32767
INTEGER_MAX = 2147483647


def in_range(low: int, high: int) -> list:
    """Validators for a number from `low` to `high` inclusive."""
    return [MinValueValidator(low), MaxValueValidator(high)]


def name_taken(name: str, *, owner: str, as_alias: bool, kind: str = "model") -> str:
    """The message for `name` already in use, as `kind` (model or adapter) `owner`'s name or one of its aliases."""
    if as_alias:
        return f"“{name}” is already an alias of {kind} “{owner}”"
    return f"“{name}” is already the name of {kind} “{owner}”"


def alias_is_own_name(name: str) -> str:
    """The message for an alias equal to its own model's name."""
    return f"“{name}” is this model's own name; an alias must differ from it"


def engine_args_problem(value, engine: str = "") -> str | None:
    """Why `value` is not an argv (a JSON list of strings), naming what it is instead, or why `engine` would
    refuse the context or KV cache dtype it sets (engine_flags.refused_value); None if neither."""
    expected = "Engine args must be a JSON list of strings (an argv)"
    if isinstance(value, list):
        bad = [i for i, arg in enumerate(value) if not isinstance(arg, str)]
        if bad:
            return f"{expected}; item {bad[0]} is not a string."
        problem = refused_value(engine, value)
        return None if problem is None else f"{problem[0].upper()}{problem[1:]}."
    # isinstance, not type(): the admin's JSON field hands over str and dict subclasses.
    kinds = ((dict, "an object"), (str, "a shell string"), (bool, "a boolean"), (int | float, "a number"))
    fallback = "null" if value is None else f"a {type(value).__name__}"
    what = next((name for kind, name in kinds if isinstance(value, kind)), fallback)
    return f"{expected}, not {what}."


def engine_env_problem(value) -> str | None:
    """Why `value` is not an engine environment (names to string values), naming the variable; None if it is one.

    The rule is the agent's (nodewire/engine_env.py), so a profile the catalog takes is one its agents start.
    """
    return env_problem(value)


def keep_stored_secrets(submitted, stored: dict, siblings: Iterable[dict] = ()) -> tuple[Any, str | None]:
    """`submitted` with every secret shown as the mask given its stored value back, and a problem or None.

    Export, REST reads and admin show secret values as the mask; handing the
    mask back means "keep the value". `stored` is the env of the profile being
    written ({} for a new one), `siblings` those of its model's other profiles:
    the mask takes the one value they all hold for the name (so reordering
    profiles keeps each secret), else this profile's own. A mask with no
    stored value behind it is refused, naming the variable.
    """
    if not isinstance(submitted, dict):
        return submitted, None  # engine_env_problem names what is wrong
    envs = [stored, *siblings]
    kept = dict(submitted)
    for name, value in submitted.items():
        if not (isinstance(name, str) and is_secret(name) and value == MASK):
            continue
        values = {env[name] for env in envs if isinstance(env, dict) and name in env}
        if len(values) == 1:
            kept[name] = values.pop()
        elif name in stored:
            kept[name] = stored[name]
        else:
            held = "no profile of this model has one" if not values else "this model's profiles hold different ones"
            return (
                submitted,
                f"Variable {name}: “{MASK}” stands for a value already stored, and {held}; give the value.",
            )
    return kept, None


# The model's size as the operator gives it, for the memory model (catalog/memory.py) when neither the
# weights' headers nor a config.json can be read; all optional. The catalog file, its export, the admin and
# the REST API read this one list.
MODEL_SIZE_FIELDS = ("parameters_billions", "dtype", "layers", "kv_heads", "head_dim")


def size_problems(model: Any) -> dict[str, str]:
    """What is half-given in a model's size fields: the weights need parameters and dtype together, the KV
    cache layers, KV heads and head dim together (a part alone would be silently ignored)."""
    errors = {}
    if (model.parameters_billions is None) != (not model.dtype):
        missing = "dtype" if model.parameters_billions is not None else "parameters_billions"
        errors[missing] = "Give parameters (billions) and the weights dtype together, or neither."
    kv = {"layers": model.layers, "kv_heads": model.kv_heads, "head_dim": model.head_dim}
    if any(v is not None for v in kv.values()) and any(v is None for v in kv.values()):
        missing = next(name for name, v in kv.items() if v is None)
        errors[missing] = "Give layers, KV heads and head dim together (the KV cache's shape), or none of them."
    return errors


def sleep_problem(engine: str, level: int | None, after: int | None) -> tuple[str, str] | None:
    """(field, message) when a profile's sleep settings cannot be honoured by its engine; else None."""
    levels = ENGINE_SLEEP_LEVELS.get(engine, ())
    if level not in (None, SleepLevel.NEVER) and level not in levels:
        name = Engine(engine).label if engine in Engine.values else engine
        can = f"only sleep level {', '.join(map(str, levels))}" if levels else "not sleep"
        return "sleep_level", f"{name} can {can}; leave sleep level empty to take the best it allows, or 0."
    if after is not None and (level == SleepLevel.NEVER or not levels):
        return "sleep_after_seconds", "Replicas of this profile never sleep; leave sleep after empty."
    return None


# The LoRA ranks vLLM starts with (its `--max-lora-rank` choices, vllm/config/lora.py of 0.32); 16 when unset.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Engines that load LoRA adapters at run time; llama.cpp only takes adapters given at start-up.
ADAPTER_ENGINES = (Engine.VLLM, Engine.SGLANG, Engine.MOCK)


def adapters_problem(engine: str, max_adapters: int | None, max_adapter_rank: int | None) -> tuple[str, str] | None:
    """(field, message) when a profile's adapter settings cannot be honoured by its engine; else None."""
    name = Engine(engine).label if engine in Engine.values else engine
    if engine not in ADAPTER_ENGINES:
        for field, value in (("max_adapters", max_adapters), ("max_adapter_rank", max_adapter_rank)):
            if value is not None:
                return field, f"{name} cannot load adapters at run time; leave {field.replace('_', ' ')} empty."
        return None
    if max_adapter_rank is not None and max_adapters is None:
        return "max_adapter_rank", "A max adapter rank needs max adapters (the slots); set both or neither."
    if engine == Engine.VLLM and max_adapter_rank is not None and max_adapter_rank not in VLLM_LORA_RANKS:
        ranks = ", ".join(map(str, VLLM_LORA_RANKS))
        return "max_adapter_rank", f"vLLM takes a max adapter rank of {ranks}; {max_adapter_rank} is not one."
    return None


def adapters_kept_problem(
    slots: int | None, max_rank: int | None, adapters: list[tuple[str, int | None]], others_take_adapters: bool
) -> tuple[str, str] | None:
    """(field, message) when a profile's adapter settings would strand its model's adapters (name, known rank):
    the model's last profile taking adapters gives its slots up, or a max rank falls below an adapter's."""
    names = ", ".join(f"“{name}”" for name, _ in adapters[:3]) + (", …" if len(adapters) > 3 else "")
    if slots is None and not others_take_adapters:
        return "max_adapters", f"The model's adapters ({names}) need a profile that takes adapters; keep max adapters."
    over = [(name, rank) for name, rank in adapters if rank is not None and max_rank is not None and rank > max_rank]
    if over:
        name, rank = max(over, key=lambda item: item[1])
        return "max_adapter_rank", f"Adapter “{name}” has rank {rank}, above max adapter rank {max_rank}."
    return None


def rank_in_folder(source: str) -> int | None:
    """The LoRA rank (`r`) in `source`/adapter_config.json when `source` is a local folder holding one, else None.

    A hub id, a missing folder or an unreadable file say nothing: the rank is then unknown, not wrong.
    """
    path = Path(source) / "adapter_config.json" if source and source.startswith(("/", ".", "~")) else None
    try:
        config = json.loads(path.expanduser().read_text()) if path is not None else None
    except (OSError, ValueError, RuntimeError):  # RuntimeError: `~someone` naming no user on this machine
        return None
    rank = config.get("r") if isinstance(config, dict) else None
    return rank if isinstance(rank, int) and not isinstance(rank, bool) and rank > 0 else None


def adapter_problems(
    rank: int | None, base: str, profiles: Iterable[tuple[int | None, int | None]], aliases: Any, name: str
) -> dict[str, str]:
    """What is wrong with an adapter given its known rank and its base's profiles' (max adapters, max adapter
    rank), field by field: the base must take adapters, the rank must fit every max rank set, the aliases must
    be a list of names other than the adapter's own."""
    errors = {}
    profiles = list(profiles)
    if not any(slots for slots, _ in profiles):
        errors["base"] = f"Model “{base}” has no profile that takes adapters; set max adapters on one of its profiles."
    limits = [limit for slots, limit in profiles if slots and limit is not None]
    if rank is not None and limits and rank > min(limits):
        errors["rank"] = f"Rank {rank} is above the max adapter rank {min(limits)} of model “{base}”'s profiles."
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        errors["aliases"] = "Aliases must be a JSON list of names."
    elif name in aliases:
        errors["aliases"] = alias_is_own_name(name)
    elif len(set(aliases)) != len(aliases):
        errors["aliases"] = f"“{next(a for a in aliases if aliases.count(a) > 1)}” is listed twice."
    return errors
