"""Catalog models: a served Model, its Aliases and its ordered Profiles."""

from collections.abc import Iterable
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

from agent.engine_env import MASK, env_problem, is_secret

from .choices import ENGINE_SLEEP_LEVELS, Engine, SleepLevel, WeightsDtype

public_name_validator = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$",
    "Use letters, digits and . _ : / - (starting with a letter or digit).",
)
gpu_class_validator = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", "Use letters, digits and . _ - (e.g. H100-80GB)."
)

# The column ranges PostgreSQL enforces, checked on every path (admin, catalog files, REST) and on
# SQLite too, whose integers are unbounded: a priority of 99999999 is refused, not saved.
SMALLINT_MAX = 32767
INTEGER_MAX = 2147483647


def in_range(low: int, high: int) -> list:
    """Validators for a number from `low` to `high` inclusive."""
    return [MinValueValidator(low), MaxValueValidator(high)]


def name_taken(name: str, *, owner: str, as_alias: bool) -> str:
    """The message for `name` already in use, as model `owner`'s name or as one of its aliases."""
    if as_alias:
        return f"“{name}” is already an alias of model “{owner}”"
    return f"“{name}” is already the name of model “{owner}”"


def alias_is_own_name(name: str) -> str:
    """The message for an alias equal to its own model's name."""
    return f"“{name}” is this model's own name; an alias must differ from it"


def name_clash(
    name: str, *, own_model_name: str | None = None, models: bool = True, aliases: bool = True, alias_pk=None
) -> str | None:
    """Why `name` cannot become a new public name, or None: model names and aliases share one namespace.

    `own_model_name`: the model an alias is for (an alias must differ from it);
    `models`/`aliases`: which existing names to check; `alias_pk`: the alias
    being edited, which does not clash with itself. The catalog file checks the
    same namespace in memory (`catalog.catalog_file`), with the same messages.
    """
    if own_model_name is not None and name == own_model_name:
        return alias_is_own_name(name)
    if models:
        model = Model.objects.filter(name=name).first()
        if model is not None:
            return name_taken(name, owner=model.name, as_alias=False)
    if aliases:
        alias = Alias.objects.filter(name=name).exclude(pk=alias_pk).select_related("model").first()
        if alias is not None:
            return name_taken(name, owner=alias.model.name, as_alias=True)
    return None


def engine_args_problem(value) -> str | None:
    """Why `value` is not an argv (a JSON list of strings), naming what it is instead; None if it is one."""
    expected = "Engine args must be a JSON list of strings (an argv)"
    if isinstance(value, list):
        bad = [i for i, arg in enumerate(value) if not isinstance(arg, str)]
        return f"{expected}; item {bad[0]} is not a string." if bad else None
    # isinstance, not type(): the admin's JSON field hands over str and dict subclasses.
    kinds = ((dict, "an object"), (str, "a shell string"), (bool, "a boolean"), (int | float, "a number"))
    fallback = "null" if value is None else f"a {type(value).__name__}"
    what = next((name for kind, name in kinds if isinstance(value, kind)), fallback)
    return f"{expected}, not {what}."


def engine_env_problem(value) -> str | None:
    """Why `value` is not an engine environment (names to string values), naming the variable; None if it is one.

    The rule is the agent's (agent/engine_env.py), so a profile the catalog takes is one its agents start.
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


def size_problems(model: "Model") -> dict[str, str]:
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


class Model(models.Model):
    """A model served under a public name, with the source its weights come from, and optionally its size."""

    name = models.CharField(max_length=200, unique=True, validators=[public_name_validator])
    source = models.CharField(
        max_length=500, help_text="Where the engine loads weights from: a hub repository id or a local path."
    )
    enabled = models.BooleanField(default=True)
    parameters_billions = models.FloatField(
        "parameters (billions)",
        null=True,
        blank=True,
        validators=[MinValueValidator(0.001), MaxValueValidator(100000)],
        help_text="e.g. 70.6; with the dtype, sizes the weights when neither their headers nor a config.json "
        "can be read.",
    )
    dtype = models.CharField(
        "weights dtype",
        max_length=16,
        blank=True,
        default="",
        # Rows inserted by code that predates the column (older migrations' states, a rolling upgrade) get "".
        db_default="",
        choices=WeightsDtype.choices,
        help_text="How the weights are stored.",
    )
    layers = models.PositiveSmallIntegerField(
        null=True, blank=True, validators=in_range(1, SMALLINT_MAX), help_text="Transformer layers (KV cache size)."
    )
    kv_heads = models.PositiveSmallIntegerField(
        "KV heads", null=True, blank=True, validators=in_range(1, SMALLINT_MAX), help_text="Key/value heads per layer."
    )
    head_dim = models.PositiveSmallIntegerField(
        "head dim", null=True, blank=True, validators=in_range(1, SMALLINT_MAX), help_text="Dimension of one head."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self):
        # Another model's name is caught by the unique constraint; an alias is not.
        clash = name_clash(self.name, models=False) if self.name else None
        errors = size_problems(self)
        if clash is not None:
            errors["name"] = clash
        if errors:
            raise ValidationError(errors)


class Alias(models.Model):
    """Another public name a model answers to; unique across all names and aliases."""

    model = models.ForeignKey(Model, related_name="aliases", on_delete=models.CASCADE)
    name = models.CharField(max_length=200, unique=True, validators=[public_name_validator])

    class Meta:
        ordering = ["name"]
        verbose_name_plural = "aliases"

    def __str__(self) -> str:
        return self.name

    def clean(self):
        # Another alias is caught by the unique constraint (or AliasForm); a model's name is not.
        clash = name_clash(self.name, aliases=False) if self.name else None
        if clash is not None:
            raise ValidationError({"name": clash})


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


# What an operator sets on a profile, in the order a catalog export writes them, grouped in the rows
# the admin shows. Left out: the id, `order` (a position in the model's list) and `start_seconds`
# (learned). The catalog file, its export, the admin and the REST API all read this one list.
PROFILE_FIELD_ROWS = (
    ("engine",),
    ("gpu_class", "gpus_per_node", "nodes_per_replica"),
    ("min_replicas", "max_replicas", "target_concurrency"),
    ("priority", "pool", "weight", "idle_timeout_seconds"),
    ("max_model_len",),
    ("sleep_level", "sleep_after_seconds"),
    ("engine_args",),
    ("env",),
)
PROFILE_FIELDS = tuple(name for row in PROFILE_FIELD_ROWS for name in row)


class Profile(models.Model):
    """One way to deploy a model: engine, GPU shape, replica bounds and priority.

    A model's profiles are alternatives, tried in order when a replica is
    placed: a later one is used only when the ones before it have no room.
    The first profile sets the model's demand (min and max replicas, target
    concurrency); every profile's own max caps the replicas running on it, and
    each replica's priority and idle timeout are those of the profile it runs on.
    """

    model = models.ForeignKey(Model, related_name="profiles", on_delete=models.CASCADE)
    order = models.PositiveSmallIntegerField(
        default=0, validators=in_range(0, SMALLINT_MAX), help_text="Lower is tried first."
    )
    engine = models.CharField(max_length=16, choices=Engine.choices, default=Engine.VLLM)
    gpu_class = models.CharField(
        "GPU class", max_length=64, validators=[gpu_class_validator], help_text="e.g. H100-80GB"
    )
    gpus_per_node = models.PositiveSmallIntegerField("GPUs per node", default=1, validators=in_range(1, SMALLINT_MAX))
    nodes_per_replica = models.PositiveSmallIntegerField(
        "nodes per replica", default=1, validators=in_range(1, SMALLINT_MAX)
    )
    min_replicas = models.PositiveSmallIntegerField("min replicas", default=0, validators=in_range(0, SMALLINT_MAX))
    max_replicas = models.PositiveSmallIntegerField("max replicas", default=1, validators=in_range(1, SMALLINT_MAX))
    priority = models.SmallIntegerField(
        default=0,
        validators=in_range(-SMALLINT_MAX - 1, SMALLINT_MAX),
        help_text="Higher is preferred and evicted last.",
    )
    pool = models.CharField(max_length=64, default="default")
    weight = models.PositiveSmallIntegerField(
        default=1,
        validators=in_range(1, SMALLINT_MAX),
        help_text="Share of the pool's traffic relative to its other replicas.",
    )
    idle_timeout_seconds = models.PositiveIntegerField(
        "idle timeout (seconds)",
        null=True,
        blank=True,
        validators=in_range(0, INTEGER_MAX),
        help_text="Stop replicas above min after this long unused (known idle only); "
        "empty = the fleet default (LLMGW_DEFAULT_IDLE_TIMEOUT_SECONDS); 0 = never.",
    )
    target_concurrency = models.PositiveSmallIntegerField(
        "target concurrency",
        default=8,
        validators=in_range(1, SMALLINT_MAX),
        help_text="Requests in flight per ready replica above which the model scales out (up to max replicas).",
    )
    max_model_len = models.PositiveIntegerField(
        "max model length",
        null=True,
        blank=True,
        validators=in_range(1, INTEGER_MAX),
        help_text="Tokens one sequence may hold (prompt and answer); passed to the engine (vLLM --max-model-len, "
        "SGLang --context-length, llama.cpp --ctx-size) unless its engine args set it; empty = the model's own.",
    )
    sleep_level = models.PositiveSmallIntegerField(
        "sleep level",
        null=True,
        blank=True,
        choices=SleepLevel.choices,
        help_text="How idle replicas give up their GPUs instead of stopping (vLLM, SGLang, mock); "
        "empty = the best the engine and the node's host memory allow.",
    )
    sleep_after_seconds = models.PositiveIntegerField(
        "sleep after (seconds)",
        null=True,
        blank=True,
        validators=in_range(0, INTEGER_MAX),
        help_text="Put replicas above min to sleep after this long unused (known idle only); "
        "empty = only when their GPUs are wanted by another model. The idle timeout still stops them.",
    )
    engine_args = models.JSONField(
        "engine args", default=list, blank=True, help_text='Extra engine argv, e.g. ["--max-model-len", "8192"].'
    )
    env = models.JSONField(
        "engine env",
        default=dict,
        # Rows inserted by code that predates the column (older migrations' states, a rolling upgrade) get {}.
        db_default=models.Value({}, output_field=models.JSONField()),
        blank=True,
        help_text='Extra environment for the engine process, e.g. {"OMP_NUM_THREADS": "8"}; values are strings. '
        f"Values of names ending in KEY, TOKEN, SECRET or PASSWORD are shown as {MASK}; "
        f"leave {MASK} to keep the stored value.",
    )
    start_seconds = models.FloatField(
        "start time (seconds)",
        null=True,
        blank=True,
        editable=False,
        help_text="Learned: how long a replica takes from placement to ready (a moving average).",
    )
    wake_seconds = models.FloatField(
        "wake time (seconds)",
        null=True,
        blank=True,
        editable=False,
        help_text="Learned: how long a sleeping replica takes from its wake to ready (a moving average).",
    )

    class Meta:
        ordering = ["model", "order", "id"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(max_replicas__gte=models.F("min_replicas")), name="profile_max_replicas_gte_min"
            ),
            models.CheckConstraint(condition=models.Q(gpus_per_node__gte=1), name="profile_gpus_per_node_gte_1"),
            models.CheckConstraint(
                condition=models.Q(nodes_per_replica__gte=1), name="profile_nodes_per_replica_gte_1"
            ),
            models.CheckConstraint(condition=models.Q(max_replicas__gte=1), name="profile_max_replicas_gte_1"),
            models.CheckConstraint(condition=models.Q(weight__gte=1), name="profile_weight_gte_1"),
        ]

    def __str__(self) -> str:
        shape = f"{self.gpus_per_node}x{self.gpu_class}"
        if self.nodes_per_replica > 1:
            shape = f"{self.nodes_per_replica} nodes of {shape}"
        return f"{self.model_id and self.model.name} on {shape} ({self.get_engine_display()})"

    def clean(self):
        errors = {}
        problem = engine_args_problem(self.engine_args)
        if problem is not None:
            errors["engine_args"] = problem
        problem = engine_env_problem(self.env)
        if problem is not None:
            errors["env"] = problem
        if self.min_replicas is not None and self.max_replicas is not None and self.max_replicas < self.min_replicas:
            errors["max_replicas"] = f"Max replicas ({self.max_replicas}) is below min replicas ({self.min_replicas})."
        if self.engine == Engine.LLAMACPP and (self.nodes_per_replica or 1) > 1:
            errors["nodes_per_replica"] = "llama.cpp replicas run on one node; set nodes per replica to 1."
        problem = sleep_problem(self.engine, self.sleep_level, self.sleep_after_seconds)
        if problem is not None:
            errors[problem[0]] = problem[1]
        if self.gpus_per_node and self.gpus_per_node > 16:
            errors["gpus_per_node"] = "No node carries more than 16 GPUs; check GPUs per node."
        if errors:
            raise ValidationError(errors)
