"""The typed shape of `cluster_summary()` for GET /api/v1/status (documentation of the one summary, no logic).

The view returns the summary itself; these serializers only describe it, so
the schema states each field's real type. Keep them in step with
`dashboard.summary` and `dashboard.stoppable` (the schemathesis test checks
every response against them).
"""

from rest_framework import serializers

from dashboard.summary import GPU_STATES, REPLICA_STATES


class LeaderSerializer(serializers.Serializer):
    owner = serializers.CharField()
    epoch = serializers.IntegerField()
    expires_in_seconds = serializers.FloatField()


class PartitionBrakeSerializer(serializers.Serializer):
    engaged = serializers.BooleanField()
    silent_nodes = serializers.IntegerField()
    watched_nodes = serializers.IntegerField()
    fraction = serializers.FloatField()


class CapacitySerializer(serializers.Serializer):
    gpu_class = serializers.CharField()
    total = serializers.IntegerField()

    def get_fields(self):
        fields = super().get_fields()
        fields.update({state: serializers.IntegerField() for state in GPU_STATES})
        return fields


class FreeNodesSerializer(serializers.Serializer):
    fabric = serializers.CharField(allow_blank=True)
    gpu_class = serializers.CharField()
    whole_free_nodes = serializers.IntegerField()
    nodes = serializers.ListField(child=serializers.CharField())


class NodeCountsSerializer(serializers.Serializer):
    total = serializers.IntegerField()
    ready = serializers.IntegerField()
    unreachable = serializers.IntegerField()
    lost = serializers.IntegerField()
    new = serializers.IntegerField()
    cordoned = serializers.IntegerField()


class ReplicaCountsSerializer(serializers.Serializer):
    total = serializers.IntegerField()

    def get_fields(self):
        fields = super().get_fields()
        fields.update({state: serializers.IntegerField() for state in REPLICA_STATES})
        return fields


class ModelStatusSerializer(serializers.Serializer):
    name = serializers.CharField()
    enabled = serializers.BooleanField()
    wanted = serializers.IntegerField()
    ready = serializers.IntegerField()


class UnplaceableSerializer(serializers.Serializer):
    model = serializers.CharField()
    reason = serializers.CharField()
    pending = serializers.IntegerField()


class ReplicaStatusSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    model = serializers.CharField()
    profile_id = serializers.IntegerField()
    state = serializers.CharField()
    nodes = serializers.ListField(child=serializers.CharField())
    gpus = serializers.IntegerField()
    endpoint = serializers.CharField(allow_blank=True)
    ready_at = serializers.DateTimeField(allow_null=True)
    last_used = serializers.DateTimeField(allow_null=True)
    idle_seconds = serializers.FloatField(help_text="-1 when unknown (see idle_known).")
    idle_known = serializers.BooleanField()


class UsageStateSerializer(serializers.Serializer):
    known = serializers.BooleanField()
    since = serializers.DateTimeField(allow_null=True)
    reason = serializers.CharField(allow_blank=True)


class IdleHeldClassSerializer(serializers.Serializer):
    gpu_class = serializers.CharField()
    gpus = serializers.IntegerField()


class IdleHeldSerializer(serializers.Serializer):
    total = serializers.IntegerField()
    by_class = IdleHeldClassSerializer(many=True)


class StoppableSerializer(serializers.Serializer):
    replica = serializers.IntegerField()
    model = serializers.CharField()
    gpu_class = serializers.CharField()
    gpus = serializers.IntegerField()
    nodes = serializers.ListField(child=serializers.CharField())
    idle_seconds = serializers.FloatField()
    idle = serializers.CharField()
    frees = serializers.CharField(allow_blank=True)
    unblocks = serializers.ListField(child=serializers.CharField())


class StatusSerializer(serializers.Serializer):
    """The cluster summary: the same data as `ctl_status`, the dashboard and the fleet metrics."""

    generated_at = serializers.DateTimeField()
    leader = LeaderSerializer(allow_null=True)
    partition_brake = PartitionBrakeSerializer()
    capacity = CapacitySerializer(many=True)
    free_nodes = FreeNodesSerializer(many=True)
    nodes = NodeCountsSerializer()
    replicas = ReplicaCountsSerializer()
    models = ModelStatusSerializer(many=True)
    unplaceable = UnplaceableSerializer(many=True)
    replica_list = ReplicaStatusSerializer(many=True)
    usage = UsageStateSerializer()
    idle_held_gpus = IdleHeldSerializer()
    stoppable = StoppableSerializer(many=True)
