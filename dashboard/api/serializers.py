"""Serializers for the REST API; related rows come from the viewsets' prefetches. Writes are checked in `writes`."""

from typing import Any, cast

from django.utils import timezone
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from catalog.catalog_file import ADAPTER_KEYS, MODEL_KEYS, PROFILE_FIELDS
from catalog.models import Adapter, Model, Profile
from inventory.models import GPU, Node
from keys.models import ApiKey, TokenUsage
from nodewire.engine_env import MASK, masked
from reconciler.choices import AdapterLoadState
from reconciler.demand.idle import Idle
from reconciler.models import Replica

ENV_HELP = (
    'Extra environment for the engine process, names to string values, e.g. {"OMP_NUM_THREADS": "8"}. '
    f"Values of names ending in KEY, TOKEN, SECRET or PASSWORD read as {MASK}; "
    f"writing {MASK} back keeps the stored value."
)


class MaskedEnvField(serializers.DictField):
    """A profile's engine env as read: secret values masked (nodewire/engine_env.py)."""

    def __init__(self, **kwargs):
        super().__init__(child=serializers.CharField(), read_only=True, help_text=ENV_HELP, **kwargs)

    def to_representation(self, value):
        return super().to_representation(masked(value or {}))


class ProfileSerializer(serializers.ModelSerializer):
    """A profile as read (with its id, order and learned start time); secret env values masked."""

    engine_args = serializers.ListField(child=serializers.CharField(), read_only=True)
    env = MaskedEnvField()

    class Meta:
        model = Profile
        # The fields a catalog file sets (one list for both), with the row's id, order and learned start time.
        fields = ["id", "order", *PROFILE_FIELDS, "start_seconds"]


class AdapterSerializer(serializers.ModelSerializer):
    """A LoRA adapter on a model, in the catalog file's keys (written through the model, like profiles)."""

    aliases = serializers.ListField(child=serializers.CharField(), read_only=True)

    class Meta:
        model = Adapter
        fields = list(ADAPTER_KEYS)


class ModelSerializer(serializers.ModelSerializer):
    """A catalog model with its alias names, its profiles in placement order and its adapters by name."""

    aliases: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        many=True, read_only=True, slug_field="name"
    )
    profiles = ProfileSerializer(many=True, read_only=True)
    adapters = AdapterSerializer(many=True, read_only=True)

    class Meta:
        model = Model
        fields = [
            "id",
            *MODEL_KEYS,  # a catalog file's entry, as the API writes it
            "created_at",
            "updated_at",
        ]


class ModelWrittenSerializer(ModelSerializer):
    """A model as a write answers it: the model, and warnings that do not stop the write."""

    warnings = serializers.ListField(
        child=serializers.CharField(),
        read_only=True,
        help_text="Profiles whose memory estimate does not fit their GPU class, with the numbers, e.g. "
        '"profiles[0] L40S-48GB×2: does_not_fit: needs 68.9 GiB per GPU; L40S-48GB has 44.2 GiB usable (…)". '
        "The write is done; placement will not put those profiles on GPUs too small for them.",
    )

    class Meta(ModelSerializer.Meta):
        fields = [*ModelSerializer.Meta.fields, "warnings"]


class GPUSerializer(serializers.ModelSerializer):
    class Meta:
        model = GPU
        fields = ["index", "uuid", "gpu_class", "memory_mb", "health", "health_reason", "healthy_since"]


class NodeSerializer(serializers.ModelSerializer):
    """A node with the GPUs its agent last reported.

    address, fabric and labels are the operator's (blank: the agent's report
    stands in); reported_* are what the agent said, and warnings name where the two differ.
    """

    gpus = GPUSerializer(many=True, read_only=True)
    warnings = serializers.SerializerMethodField()

    class Meta:
        model = Node
        fields = [
            "id",
            "name",
            "address",
            "fabric",
            "labels",
            "reported_address",
            "reported_fabric",
            "reported_labels",
            "warnings",
            "schedulable",
            "state",
            "last_seen",
            "agent_version",
            "gpus",
        ]

    def get_warnings(self, node: Node) -> list[str]:
        return node.report_warnings()


class ReplicaAdaptersSerializer(serializers.Serializer):
    """The LoRA adapters on a replica, by name: loaded, and loading (the load sent, not answered yet)."""

    loaded = serializers.ListField(child=serializers.CharField())
    loading = serializers.ListField(child=serializers.CharField())


class ReplicaSerializer(serializers.ModelSerializer):
    """A replica with its nodes and idle time; unknown idle is -1 with idle_known false (DESIGN invariant 3)."""

    model: serializers.SlugRelatedField[Model] = serializers.SlugRelatedField(read_only=True, slug_field="name")
    nodes = serializers.SerializerMethodField()
    gpus = serializers.SerializerMethodField()
    idle_seconds = serializers.SerializerMethodField()
    idle_known = serializers.SerializerMethodField()
    host_memory_bytes = serializers.SerializerMethodField()
    wake_seconds = serializers.FloatField(source="profile.wake_seconds", read_only=True, allow_null=True)
    adapters = serializers.SerializerMethodField()
    # The field's name in the API since its first version; the column is `placement_note`.
    placement_error = serializers.CharField(source="placement_note", read_only=True)

    class Meta:
        model = Replica
        fields = [
            "id",
            "model",
            "profile",
            "state",
            "nodes",
            "gpus",
            "endpoint_url",
            "placement_error",
            "hold",
            "last_error",
            "failure_count",
            "created_at",
            "started_at",
            "ready_at",
            "last_used",
            "idle_seconds",
            "idle_known",
            "stopping_since",
            "stop_reason",
            "demand_until",
            "sleep_level",
            "sleeping_level",
            "sleeping_since",
            "host_memory_bytes",
            "wake_seconds",
            "adapters",
        ]

    def _now(self):
        # One "now" per response, so replicas in a list are comparable.
        context = cast(dict[str, Any], self.context)  # a dict DRF builds per response
        return context.setdefault("now", timezone.now())

    def _shards(self, obj):
        return sorted(obj.shards.all(), key=lambda shard: shard.rank)

    def get_nodes(self, obj) -> list[str]:
        return [shard.node.name for shard in self._shards(obj)]

    def get_gpus(self, obj) -> int:
        return sum(len(shard.gpu_assignments.all()) for shard in obj.shards.all())

    def _idle(self, obj) -> Idle:
        return obj.idle(self._now())

    def get_idle_seconds(self, obj) -> float:
        return self._idle(obj).json_seconds()

    def get_idle_known(self, obj) -> bool:
        return self._idle(obj).known

    def get_host_memory_bytes(self, obj) -> int | None:
        """What a level-1 sleeper holds in its nodes' host memory (its weights); None otherwise."""
        return obj.weights_bytes if obj.sleeping_level == 1 else None

    @extend_schema_field(ReplicaAdaptersSerializer)
    def get_adapters(self, obj) -> dict[str, list[str]]:
        """Its loads taking a slot, from the viewset's prefetch (ordered by adapter name)."""
        names: dict[str, list[str]] = {AdapterLoadState.LOADED: [], AdapterLoadState.LOADING: []}
        for load in obj.adapter_loads.all():
            if load.state in names:
                names[load.state].append(load.adapter.name)
        return {"loaded": names[AdapterLoadState.LOADED], "loading": names[AdapterLoadState.LOADING]}


class TokenUsageSerializer(serializers.ModelSerializer):
    """Tokens one API key spent on one model in one hour (`key` is the key's name; `key_id` null once deleted), what
    they cost at the prices when counted, and the key's team and holder then."""

    key = serializers.CharField(source="key_name", read_only=True)
    spend = serializers.DecimalField(
        max_digits=32, decimal_places=12, read_only=True, help_text="In the catalog's currency unit, exact."
    )

    class Meta:
        model = TokenUsage
        fields = [
            "id", "key", "key_id", "model", "hour", "requests", "prompt_tokens", "completion_tokens", "spend", "team",
            "user",
        ]  # fmt: skip


class ApiKeySerializer(serializers.ModelSerializer):
    """An API key for the router as read; its secret is never shown again after creation (written: write_serializers)."""

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "name",
            "prefix",
            "active",
            "created_at",
            "allowed_models",
            "allowed_pools",
            "expires_at",
            "rpm",
            "tpm",
            "priority_class",
            "last_used_at",
            "team",
            "user",
        ]
        read_only_fields = ["id", "prefix", "active", "created_at", "last_used_at", "team", "user"]

    def get_fields(self):
        fields = super().get_fields()
        for name in ("allowed_models", "allowed_pools"):
            fields[name] = serializers.ListField(child=serializers.CharField(), read_only=True)
        return fields


class NewApiKeySerializer(ApiKeySerializer):
    """A key just created, with its secret: store it now, it is not shown again."""

    key = serializers.CharField(read_only=True, help_text="The secret; shown this once.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]


class DrainedSerializer(serializers.Serializer):
    """What draining a node did."""

    node = NodeSerializer()
    replicas_stopped = serializers.IntegerField()
