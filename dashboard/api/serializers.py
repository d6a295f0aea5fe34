"""Read-only serializers for the REST API; related rows come from the viewsets' prefetches."""

from django.utils import timezone
from rest_framework import serializers

from catalog.models import Model, Profile
from inventory.models import GPU, Node
from reconciler.idle import Idle
from reconciler.models import Replica
from router.models import TokenUsage


class ProfileSerializer(serializers.ModelSerializer):
    class Meta:
        model = Profile
        fields = [
            "id",
            "order",
            "engine",
            "gpu_class",
            "gpus_per_node",
            "nodes_per_replica",
            "min_replicas",
            "max_replicas",
            "target_concurrency",
            "priority",
            "pool",
            "weight",
            "idle_timeout_seconds",
            "engine_args",
            "start_seconds",
        ]


class ModelSerializer(serializers.ModelSerializer):
    """A catalog model with its alias names and its profiles in placement order."""

    aliases = serializers.SlugRelatedField(many=True, read_only=True, slug_field="name")
    profiles = ProfileSerializer(many=True, read_only=True)

    class Meta:
        model = Model
        fields = ["id", "name", "source", "enabled", "aliases", "profiles", "created_at", "updated_at"]


class GPUSerializer(serializers.ModelSerializer):
    class Meta:
        model = GPU
        fields = ["index", "uuid", "gpu_class", "memory_mb", "health", "healthy_since"]


class NodeSerializer(serializers.ModelSerializer):
    """A node with the GPUs its agent last reported."""

    gpus = GPUSerializer(many=True, read_only=True)

    class Meta:
        model = Node
        fields = [
            "id",
            "name",
            "address",
            "fabric",
            "labels",
            "schedulable",
            "state",
            "last_seen",
            "agent_version",
            "gpus",
        ]


class ReplicaSerializer(serializers.ModelSerializer):
    """A replica with its nodes and idle time; unknown idle is -1 with idle_known false (DESIGN invariant 3)."""

    model = serializers.SlugRelatedField(read_only=True, slug_field="name")
    nodes = serializers.SerializerMethodField()
    gpus = serializers.SerializerMethodField()
    idle_seconds = serializers.SerializerMethodField()
    idle_known = serializers.SerializerMethodField()

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
        ]

    def _now(self):
        # One "now" per response, so replicas in a list are comparable.
        return self.context.setdefault("now", timezone.now())

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


class TokenUsageSerializer(serializers.ModelSerializer):
    """Tokens one API key spent on one model in one hour (`key` is the key's name; `key_id` null once deleted)."""

    key = serializers.CharField(source="key_name", read_only=True)

    class Meta:
        model = TokenUsage
        fields = ["id", "key", "key_id", "model", "hour", "requests", "prompt_tokens", "completion_tokens"]
