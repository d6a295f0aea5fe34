"""Catalog models: a served Model, its Aliases, its ordered Profiles and the LoRA Adapters riding on it."""

from decimal import Decimal

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

from catalog.choices import Engine, SleepLevel, WeightsDtype
from catalog.prices import PRICE_DECIMAL_PLACES, PRICE_MAX_DIGITS, Prices, inherited
from catalog.rules import (
    INTEGER_MAX,
    SMALLINT_MAX,
    adapter_problems,
    adapters_kept_problem,
    adapters_problem,
    alias_is_own_name,
    engine_args_problem,
    engine_env_problem,
    in_range,
    name_taken,
    rank_in_folder,
    size_problems,
    sleep_problem,
)
from nodewire.engine_env import MASK

public_name_validator = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$",
    "Use letters, digits and . _ : / - (starting with a letter or digit).",
)
gpu_class_validator = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", "Use letters, digits and . _ - (e.g. H100-80GB)."
)
# A model's and an adapter's prices, in the order the catalog file, the admin and the REST API list them.
PRICE_FIELDS = ("price_input_per_million", "price_output_per_million")
price_validator = MinValueValidator(Decimal(0), "A price cannot be negative; 0 means free.")
TOKEN_KINDS = {"input": "prompt (input)", "output": "completion (output)"}


def price_field(kind: str, *, inherits: bool) -> models.DecimalField:
    """A price per million `kind` (input or output) tokens: a model's (0 = free) or an adapter's (empty = its
    base model's)."""
    says = (
        f"The price of a million {TOKEN_KINDS[kind]} tokens, in the organisation's own currency unit "
        "(operators of a private fleet set internal prices); "
    )
    # A model's column has a database default too, so rows written by code that predates it (a rolling upgrade) are free.
    extra: dict = {"null": True, "blank": True} if inherits else {"default": Decimal(0), "db_default": Decimal(0)}
    return models.DecimalField(
        f"{kind} price per million tokens",
        max_digits=PRICE_MAX_DIGITS,
        decimal_places=PRICE_DECIMAL_PLACES,
        validators=[price_validator],
        help_text=says + ("empty = the base model's price; 0 = free." if inherits else "0 = free."),
        **extra,
    )


def name_clash(
    name: str,
    *,
    own_model_name: str | None = None,
    models: bool = True,
    aliases: bool = True,
    alias_pk=None,
    adapters: bool = True,
    adapter_pk=None,
) -> str | None:
    """Why `name` cannot become a new public name, or None: model names, their aliases, adapter names and
    their aliases share one namespace (a request names any of them as its `model`).

    `own_model_name`: the model an alias is for (an alias must differ from it);
    `models`/`aliases`/`adapters`: which existing names to check; `alias_pk`,
    `adapter_pk`: the alias or adapter being edited, which does not clash with
    itself. The catalog file checks the same namespace in memory
    (`catalog.catalog_file`), with the same messages.
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
    if adapters:
        # Adapter aliases are a JSON list, which SQLite cannot search inside: read the names, not the rows.
        for owner, owner_aliases in Adapter.objects.exclude(pk=adapter_pk).values_list("name", "aliases"):
            if name == owner or name in (owner_aliases or ()):
                return name_taken(name, owner=owner, as_alias=name != owner, kind="adapter")
    return None


class Model(models.Model):
    """A model served under a public name, with the source its weights come from, and optionally its size."""

    name = models.CharField(max_length=200, unique=True, validators=[public_name_validator])
    source = models.CharField(
        max_length=500, help_text="Where the engine loads weights from: a hub repository id or a local path."
    )
    enabled = models.BooleanField(default=True)
    continue_streams = models.BooleanField(
        "continue broken streams",
        default=True,
        db_default=True,  # rows written by code that predates it (a rolling upgrade) keep the default
        help_text="When a replica breaks off a streamed answer (its engine died, its node was lost), routers ask "
        "another replica for the rest, so the client's stream goes on (LLMGW_STREAM_MIGRATIONS bounds the tries in a "
        "row that bring no token).",
    )
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
    price_input_per_million = price_field("input", inherits=False)
    price_output_per_million = price_field("output", inherits=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def prices(self) -> Prices:
        """What a million of its prompt and completion tokens cost."""
        return Prices(self.price_input_per_million, self.price_output_per_million)

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


# What an operator sets on a profile, in the order a catalog export writes them, grouped in the rows
# the admin shows. Left out: the id, `order` (a position in the model's list) and `start_seconds`
# (learned). The catalog file, its export, the admin and the REST API all read this one list.
PROFILE_FIELD_ROWS = (
    ("engine",),
    ("gpu_class", "gpus_per_node", "nodes_per_replica"),
    ("min_replicas", "max_replicas", "target_concurrency", "max_concurrency"),
    ("ttft_objective_seconds", "itl_objective_seconds"),
    ("priority", "pool", "weight", "idle_timeout_seconds"),
    ("max_model_len", "prefetch_nodes"),
    ("sleep_level", "sleep_after_seconds"),
    ("max_adapters", "max_adapter_rank"),
    ("engine_args",),
    ("env",),
)
PROFILE_FIELDS = tuple(name for row in PROFILE_FIELD_ROWS for name in row)


class Profile(models.Model):
    """One way to deploy a model: engine, GPU shape, replica bounds and priority.

    A model's profiles are alternatives, tried in order when a replica is
    placed: a later one is used only when the ones before it have no room.
    The first profile sets the model's demand (min and max replicas, target
    concurrency or latency objectives); every profile's own max caps the replicas running on it, and
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
    max_concurrency = models.PositiveSmallIntegerField(
        "max concurrency",
        null=True,
        blank=True,
        validators=in_range(1, SMALLINT_MAX),
        help_text="Requests one replica runs at once, passed as its engine's batch (vLLM --max-num-seqs, "
        "SGLang --max-running-requests; llama.cpp's --parallel is the engine args' to set) unless the engine args set "
        "it. Past it, each router holds the model's requests in its fair "
        "queue (priority class, then each team's weighted share) instead of the engine's first come, first served; "
        "empty = no queue in the routers.",
    )
    ttft_objective_seconds = models.FloatField(
        "time to first token objective (seconds)",
        null=True,
        blank=True,
        validators=[MinValueValidator(0.001, "An objective must be above 0 seconds."), MaxValueValidator(3600)],
        help_text="The p90 of streamed answers' time to first token (queue wait included) the model should keep. "
        "With an objective, scale-out follows the worst p90 over its objective instead of target concurrency; "
        "empty = no objective.",
    )
    itl_objective_seconds = models.FloatField(
        "inter-token objective (seconds)",
        null=True,
        blank=True,
        validators=[MinValueValidator(0.0001, "An objective must be above 0 seconds."), MaxValueValidator(60)],
        help_text="The p90 of the gaps between a streamed answer's tokens the model should keep; empty = none.",
    )
    max_model_len = models.PositiveIntegerField(
        "max model length",
        null=True,
        blank=True,
        validators=in_range(1, INTEGER_MAX),
        help_text="Tokens one sequence may hold (prompt and answer); passed to the engine (vLLM --max-model-len, "
        "SGLang --context-length, llama.cpp --ctx-size) unless its engine args set it; empty = the model's own.",
    )
    prefetch_nodes = models.PositiveSmallIntegerField(
        "keep weights on (nodes)",
        null=True,
        blank=True,
        validators=in_range(1, SMALLINT_MAX),
        help_text="Keep its hub weights staged on this many nodes of its GPU class ahead of demand, pinned: never "
        "evicted for another model's weights (vLLM, SGLang; needs agents with a weights root). More than the class "
        "has: every node of it. Empty = staged only when a replica needs them.",
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
    max_adapters = models.PositiveSmallIntegerField(
        "max adapters",
        null=True,
        blank=True,
        validators=in_range(1, SMALLINT_MAX),
        help_text="LoRA adapters one replica holds at once (vLLM --max-loras, SGLang --max-loras-per-batch); "
        "empty = this profile takes no adapters.",
    )
    max_adapter_rank = models.PositiveSmallIntegerField(
        "max adapter rank",
        null=True,
        blank=True,
        validators=in_range(1, SMALLINT_MAX),
        help_text="The largest LoRA rank its replicas load (vLLM --max-lora-rank: 1, 8, 16, … 512); "
        "empty = the engine's default (vLLM: 16).",
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
        problem = engine_args_problem(self.engine_args, self.engine)
        if problem is not None:
            errors["engine_args"] = problem
        problem = engine_env_problem(self.env)
        if problem is not None:
            errors["env"] = problem
        if self.min_replicas is not None and self.max_replicas is not None and self.max_replicas < self.min_replicas:
            errors["max_replicas"] = f"Max replicas ({self.max_replicas}) is below min replicas ({self.min_replicas})."
        if self.engine == Engine.LLAMACPP and (self.nodes_per_replica or 1) > 1:
            errors["nodes_per_replica"] = "llama.cpp replicas run on one node; set nodes per replica to 1."
        # (field, problem) pairs: each rule names the field it is about.
        for field_problem in (
            sleep_problem(self.engine, self.sleep_level, self.sleep_after_seconds),
            adapters_problem(self.engine, self.max_adapters, self.max_adapter_rank),
        ):
            if field_problem is not None:
                errors[field_problem[0]] = field_problem[1]
        if self.gpus_per_node and self.gpus_per_node > 16:
            errors["gpus_per_node"] = "No node carries more than 16 GPUs; check GPUs per node."
        adapters = [(a.name, a.known_rank) for a in self.model.adapters.all()] if self.model_id else []
        if adapters and (self.max_adapters is None or self.max_adapter_rank is not None):
            others = self.model.profiles.exclude(pk=self.pk).filter(max_adapters__isnull=False).exists()
            kept = adapters_kept_problem(self.max_adapters, self.max_adapter_rank, adapters, others)
            if kept is not None:
                errors.setdefault(*kept)
        if errors:
            raise ValidationError(errors)


class Adapter(models.Model):
    """A LoRA adapter served under its own public name, loaded at run time onto replicas of its base model.

    Its base must have a profile that takes adapters (`max_adapters`); its
    rank, when known (given, or read from a local folder's
    adapter_config.json), must fit that profile's max adapter rank.
    """

    name = models.CharField(max_length=200, unique=True, validators=[public_name_validator])
    base = models.ForeignKey(Model, related_name="adapters", on_delete=models.CASCADE)
    source = models.CharField(
        max_length=500, help_text="Where the engine loads the adapter from: a hub repository id or a local folder."
    )
    enabled = models.BooleanField(default=True, db_default=True)
    rank = models.PositiveSmallIntegerField(
        null=True,
        blank=True,
        validators=in_range(1, SMALLINT_MAX),
        help_text="The adapter's LoRA rank; empty = read from adapter_config.json when the source is a local folder.",
    )
    aliases = models.JSONField(
        default=list,
        db_default=models.Value([], output_field=models.JSONField()),
        blank=True,
        help_text='Other public names it answers to, e.g. ["support-bot"].',
    )
    price_input_per_million = price_field("input", inherits=True)
    price_output_per_million = price_field("output", inherits=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def known_rank(self) -> int | None:
        """The rank the catalog gives, else the one its local folder's adapter_config.json says, else None."""
        return self.rank if self.rank is not None else rank_in_folder(self.source)

    @property
    def prices(self) -> Prices:
        """What a million of its prompt and completion tokens cost: each price it sets, else its base model's."""
        return inherited(self.price_input_per_million, self.price_output_per_million, self.base.prices)

    def clean(self):
        # An inline form hands over a base that is not saved yet (no base_id, the object cached).
        base = self.base if self.base_id is not None or Adapter.base.field.is_cached(self) else None
        errors = {}
        if base is not None:
            # A base being added in the same form has no saved profiles yet: save it with them first.
            profiles = [(p.max_adapters, p.max_adapter_rank) for p in base.profiles.all()] if base.pk else []
            errors = adapter_problems(self.known_rank, base.name, profiles, self.aliases, self.name)
        if self.name and (clash := name_clash(self.name, adapter_pk=self.pk)):
            errors.setdefault("name", clash)
        for alias in self.aliases if "aliases" not in errors else ():
            problem = alias_name_problem(alias) or name_clash(alias, adapter_pk=self.pk)
            if problem is not None:
                errors["aliases"] = problem
                break
        if errors:
            raise ValidationError(errors)


def alias_name_problem(name: str) -> str | None:
    """Why `name` is not a well-formed public name, naming it; None if it is one."""
    try:
        public_name_validator(name)
    except ValidationError as exc:
        return f"“{name}”: {exc.messages[0]}"
    return None
