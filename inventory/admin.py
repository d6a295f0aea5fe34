"""Inventory admin: nodes with their GPUs and weights inline, cordon/uncordon, credentials, the GPU list and the
weights being staged.

GPU and weights rows are what agents report, so they are read-only here; enrolment (which
issues a node's credential) is `manage.py enrol_node`, not an admin form.
"""

from collections import Counter

from django.contrib import admin, messages
from django.utils.html import format_html_join

from catalog.admin import set_gpu_class_source
from inventory.choices import NodeState
from inventory.models import GPU, Node, NodeCredential, Weights, WeightsStage, human_size

GPU_FIELDS = ("index", "uuid", "gpu_class", "memory_mb", "health", "health_reason", "healthy_since")


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows a process owns (agents' reports, the reconciler's decisions): listed and shown, never edited by hand.

    `deletable = True` keeps deletion for rows whose removal is an operator's decision.
    """

    deletable = False

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return self.deletable and super().has_delete_permission(request, obj)


class ReadOnlyInline(admin.TabularInline):
    """An inline of rows a process owns: shown with their parent, never added, changed or deleted here."""

    extra = 0
    can_delete = False

    def get_readonly_fields(self, request, obj=None):
        return self.get_fields(request, obj)

    def has_add_permission(self, request, obj=None):
        return False


class GPUInline(ReadOnlyInline):
    model = GPU
    fields = GPU_FIELDS
    show_change_link = True


class WeightsInline(ReadOnlyInline):
    """The weights the node's agent reports on its disk, with human sizes (on disk, and the tensors' own)."""

    model = Weights
    fields = ["source", "size", "tensors", "path", "seen_at", "unused_since"]
    verbose_name_plural = "weights on disk"

    def get_readonly_fields(self, request, obj=None):
        return self.fields

    @admin.display(description="size", ordering="size_bytes")
    def size(self, obj):
        return human_size(obj.size_bytes)

    @admin.display(description="tensors (headers)")
    def tensors(self, obj):
        header = obj.header or {}
        if not isinstance(header.get("tensor_bytes"), int):
            return "-"  # not reported: an older agent, or headers it could not read
        return f"{human_size(header['tensor_bytes'])} {header.get('format', '')}"


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    """Nodes are enrolled with `manage.py enrol_node` (which issues the credential), so there is no add form;
    the name is fixed because the agent's credential is bound to it (DESIGN invariant 8)."""

    list_display = [
        "name", "state", "schedulable", "shown_fabric", "gpu_summary", "shown_address", "last_seen", "agent_version",
        "warnings",
    ]  # fmt: skip
    list_filter = ["state", "schedulable", "fabric"]
    search_fields = ["name", "address", "fabric", "reported_address", "reported_fabric"]
    readonly_fields = [
        "name", "state", "last_seen", "agent_version", "created_at",
        "reported_address", "reported_fabric", "reported_labels", "warnings",
    ]  # fmt: skip
    # The operator's address, fabric and labels are edited here; an agent's hello never overwrites them.
    fields = [
        "name", "warnings", "address", "reported_address", "fabric", "reported_fabric", "labels", "reported_labels",
        "schedulable", "state", "last_seen", "agent_version", "created_at",
    ]  # fmt: skip
    inlines = [GPUInline, WeightsInline]
    actions = ["cordon", "uncordon", "declare_lost"]

    def has_add_permission(self, request):
        return False

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("gpus")

    @admin.display(description="GPUs")
    def gpu_summary(self, obj):
        by_class = Counter(gpu.gpu_class for gpu in obj.gpus.all())
        return ", ".join(f"{n}×{gpu_class}" for gpu_class, n in sorted(by_class.items())) or "-"

    @admin.display(description="address", ordering="address")
    def shown_address(self, obj):
        return obj.effective_address or "-"

    @admin.display(description="fabric", ordering="fabric")
    def shown_fabric(self, obj):
        return obj.effective_fabric or "-"

    @admin.display(description="warnings")
    def warnings(self, obj):
        """Where the operator's address, fabric or labels disagree with what the agent reports."""
        found = obj.report_warnings()
        if not found:
            return "-"
        return format_html_join("", '<div class="warning" style="color:#ba2121">⚠ {}</div>', ((w,) for w in found))

    @admin.action(description="Cordon: place no new shards on the selected nodes", permissions=["change"])
    def cordon(self, request, queryset):
        count = queryset.update(schedulable=False)
        self.message_user(request, f"Cordoned {count} node(s); running replicas stay until stopped.", messages.SUCCESS)

    @admin.action(
        description="Declare lost: place the selected unreachable nodes' replicas elsewhere (overrides the partition brake)",
        permissions=["change"],
    )
    def declare_lost(self, request, queryset):
        count = queryset.filter(state=NodeState.UNREACHABLE).update(state=NodeState.LOST)
        self.message_user(
            request,
            f"Declared {count} unreachable node(s) lost; the leader's next tick places their replicas elsewhere.",
            messages.SUCCESS if count else messages.WARNING,
        )

    @admin.action(description="Uncordon: allow new shards on the selected nodes", permissions=["change"])
    def uncordon(self, request, queryset):
        count = queryset.update(schedulable=True)
        self.message_user(request, f"Uncordoned {count} node(s).", messages.SUCCESS)


@admin.register(GPU)
class GPUAdmin(ReadOnlyAdmin):
    list_display = ["__str__", "node", "index", "gpu_class", "memory_mb", "health", "health_reason", "healthy_since"]
    list_filter = ["gpu_class", "health", "node__fabric"]
    search_fields = ["node__name", "uuid", "gpu_class"]
    list_select_related = ["node"]


@admin.register(NodeCredential)
class NodeCredentialAdmin(ReadOnlyAdmin):
    """Read-only; deleting a credential lets the node be enrolled again with a new token."""

    list_display = ["node", "prefix", "created_at"]
    search_fields = ["node__name", "prefix"]
    list_select_related = ["node"]
    fields = ["node", "prefix", "created_at"]
    deletable = True


@admin.register(WeightsStage)
class WeightsStageAdmin(ReadOnlyAdmin):
    """Weights being put on nodes before an engine needs them (reconciler.weights.staging), as the agents report:
    how much is done, at what rate, what is left. Deleting a row forgets it (a replica waiting for it is then
    placed, and asks again if its node still lacks the weights)."""

    list_display = ["source", "node", "state", "progress", "rate", "left", "updated_at", "message"]
    list_filter = ["state"]
    search_fields = ["source", "node__name"]
    list_select_related = ["node"]
    ordering = ["state", "-updated_at"]
    deletable = True

    @admin.display(description="done", ordering="bytes_done")
    def progress(self, obj):
        if not obj.bytes_total:
            return human_size(obj.bytes_done)
        return f"{obj.bytes_done / obj.bytes_total:.0%} of {human_size(obj.bytes_total)}"

    @admin.display(description="rate", ordering="bytes_per_second")
    def rate(self, obj):
        return f"{human_size(int(obj.bytes_per_second))}/s" if obj.bytes_per_second else "-"

    @admin.display(description="left")
    def left(self, obj):
        seconds = obj.seconds_left
        return "-" if seconds is None else f"{seconds:.0f} s"


def reported_gpu_classes() -> list[str]:
    """The GPU classes nodes report, for the catalog's profile form (one query)."""
    return list(GPU.objects.order_by("gpu_class").values_list("gpu_class", flat=True).distinct())


set_gpu_class_source(reported_gpu_classes)
