"""Reconciler admin: replicas with "idle for" and a drain action; shards, GPU assignments and the lease
read-only; and the node drain action, added to inventory's node admin here because stopping replicas
is the reconciler's (inventory sits below it in the stack).

These rows belong to the leader's reconcile tick; the admin only looks, and asks
for a replica to be stopped through reconciler.lifecycle.transitions.
"""

from django.contrib import admin, messages
from django.utils import timezone

from inventory.admin import NodeAdmin, ReadOnlyAdmin, ReadOnlyInline
from inventory.models import Node
from reconciler.lifecycle.drain import drain_nodes
from reconciler.lifecycle.transitions import stop_replica
from reconciler.models import GPUAssignment, Lease, Replica, Shard


class ShardInline(ReadOnlyInline):
    model = Shard
    fields = ["rank", "node", "port", "state", "running", "message", "updated_at"]


@admin.register(Replica)
class ReplicaAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "model",
        "profile",
        "state",
        "node_names",
        "endpoint_url",
        "idle_for",
        "failure_count",
        "why",
    ]
    list_filter = ["state", "hold", "model"]
    search_fields = ["model__name", "endpoint_url", "shards__node__name"]
    list_select_related = ["model", "profile", "profile__model"]
    inlines = [ShardInline]
    actions = ["stop_replicas"]

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("shards__node")

    @admin.display(description="nodes")
    def node_names(self, obj):
        return ", ".join(s.node.name for s in sorted(obj.shards.all(), key=lambda s: s.rank)) or "-"

    @admin.display(description="why stopping / waiting")
    def why(self, obj):
        return obj.stop_reason or obj.placement_note or "-"

    @admin.display(description="idle for")
    def idle_for(self, obj):
        # Unknown last use is "-", never a duration (DESIGN invariant 3).
        return str(obj.idle(timezone.now()))

    def has_stop_permission(self, request):
        return request.user.has_perm("reconciler.change_replica")

    @admin.action(description="Drain and stop the selected replicas", permissions=["stop"])
    def stop_replicas(self, request, queryset):
        replicas = list(queryset.select_related("model").order_by("pk"))
        for replica in replicas:
            stop_replica(replica)
        self.message_user(
            request,
            f"Asked {len(replicas)} replica(s) to stop: they left the endpoint table; the leader's next tick "
            "drains them (stopped once their engines report no running requests).",
            messages.SUCCESS,
        )


@admin.register(Shard)
class ShardAdmin(ReadOnlyAdmin):
    list_display = ["id", "replica", "rank", "node", "port", "state", "running", "updated_at"]
    list_filter = ["state", "node"]
    search_fields = ["node__name", "replica__model__name"]
    list_select_related = ["replica__model", "node"]


@admin.register(GPUAssignment)
class GPUAssignmentAdmin(ReadOnlyAdmin):
    list_display = ["id", "gpu", "shard"]
    search_fields = ["gpu__node__name", "gpu__uuid"]
    list_select_related = ["gpu__node", "shard__node"]


@admin.register(Lease)
class LeaseAdmin(ReadOnlyAdmin):
    list_display = ["name", "owner", "epoch", "expires_in"]

    @admin.display(description="expires in")
    def expires_in(self, obj):
        # expires_at is by the database's clock; shown against ours for display only.
        seconds = obj.expires_at - timezone.now().timestamp()
        return f"{seconds:.1f}s" if seconds >= 0 else f"expired {-seconds:.1f}s ago"


class DrainingNodeAdmin(NodeAdmin):
    """Inventory's node admin with a drain action: cordon, then drain and stop the nodes' replicas."""

    actions = [*NodeAdmin.actions, "drain"]

    @admin.action(
        description="Drain: cordon the selected nodes and drain and stop their replicas", permissions=["change"]
    )
    def drain(self, request, queryset):
        nodes, replicas = drain_nodes(queryset.values_list("pk", flat=True))
        self.message_user(
            request,
            f"Cordoned {nodes} node(s) and asked their {replicas} replica(s) to stop (reason “node drained”): "
            "a serving replica keeps serving until its replacement on another node is ready (at once if there "
            "is no room for one), then leaves the endpoint table; engines finish their requests, then stop.",
            messages.SUCCESS,
        )


admin.site.unregister(Node)
admin.site.register(Node, DrainingNodeAdmin)
