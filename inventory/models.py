"""Inventory models: Node, GPU, the per-node NodeCredential, the Weights each node holds on disk, and the
WeightsStage under way to put more there."""

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.db.models import F, Value
from django.db.models.functions import Coalesce, NullIf

from hub.credentials import new_secret, secret_matches
from inventory.choices import GPUHealth, NodeState, StagingState
from nodewire.protocol import NODE_NAME_PATTERN

TOKEN_PREFIX = "llmgw-node-"

# Node names become channel-layer group names, which allow only these characters.
node_name_validator = RegexValidator(NODE_NAME_PATTERN, "Use letters, digits and . _ - (at most 63 characters).")


def effective(field: str, prefix: str = "") -> Coalesce:
    """A query expression for a node's effective `address` or `fabric`: the operator's, else the agent's report.

    `prefix` reaches the node through a relation (e.g. "node__" from GPU rows), so
    placement and status read the same value in the query they already run.
    """
    return Coalesce(NullIf(F(f"{prefix}{field}"), Value("")), F(f"{prefix}reported_{field}"))


def report_warnings(operator: dict[str, Any], reported: dict[str, Any]) -> list[str]:
    """One sentence per field an operator set that the node's agent reports differently.

    The operator's value wins (it is what placement and endpoints use); the
    warning is there so a stale address or a miscabled node is noticed.
    """
    warnings = []
    for field in ("address", "fabric", "labels"):
        mine, theirs = operator.get(field), reported.get(field)
        if mine and theirs and mine != theirs:
            warnings.append(f"{field} set to {_shown(mine)} but its agent reports {_shown(theirs)}")
    return warnings


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in sorted(value.items())) or "none"
    return f"“{value}”"


class NodeQuerySet(models.QuerySet):
    def schedulable(self):
        """Nodes the placer may put new shards on."""
        return self.filter(schedulable=True, state=NodeState.READY)


class Node(models.Model):
    """A GPU machine running an agent."""

    name = models.CharField(max_length=63, unique=True, validators=[node_name_validator])
    # Operator-set (admin, REST, enrolment); blank means "as the agent reports" (the reported_* fields).
    address = models.CharField(
        max_length=255, blank=True, help_text="Host or IP engines are reached on; blank: the address its agent reports."
    )
    fabric = models.CharField(
        max_length=64, blank=True, help_text="Interconnect domain, e.g. an InfiniBand fabric; blank: its agent's."
    )
    labels = models.JSONField(default=dict, blank=True, help_text="Empty: the labels its agent reports.")
    # What the agent said in its last hello; never overrides the operator's fields above.
    reported_address = models.CharField(max_length=255, blank=True, editable=False)
    reported_fabric = models.CharField(max_length=64, blank=True, editable=False)
    reported_labels = models.JSONField(default=dict, blank=True, editable=False)
    schedulable = models.BooleanField(default=True, help_text="Cordoned nodes get no new shards.")
    state = models.CharField(max_length=16, choices=NodeState.choices, default=NodeState.NEW)
    last_seen = models.DateTimeField(null=True, blank=True)
    agent_version = models.CharField(max_length=64, blank=True)
    reported_host_memory_mib = models.PositiveIntegerField(
        "host memory (MiB)", null=True, blank=True, editable=False, help_text="As its agent reports it."
    )
    weights_port = models.PositiveIntegerField(
        null=True,
        blank=True,
        editable=False,
        help_text="Where its agent's weights server listens, for peers copying its weights (empty: it serves none).",
    )
    stages_weights = models.BooleanField(
        default=False,
        editable=False,
        help_text="Its agent has a weights root, so weights can be staged there before an engine starts "
        "(as its hello says).",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = NodeQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def effective_address(self) -> str:
        return self.address or self.reported_address

    @property
    def effective_fabric(self) -> str:
        return self.fabric or self.reported_fabric

    def report_warnings(self) -> list[str]:
        """Where the operator's address, fabric or labels disagree with the agent's report."""
        return report_warnings(
            {"address": self.address, "fabric": self.fabric, "labels": self.labels},
            {"address": self.reported_address, "fabric": self.reported_fabric, "labels": self.reported_labels},
        )


class GPU(models.Model):
    """One GPU of a node, as its agent last reported it."""

    node = models.ForeignKey(Node, related_name="gpus", on_delete=models.CASCADE)
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField("UUID", max_length=128)
    gpu_class = models.CharField("GPU class", max_length=64)
    memory_mb = models.PositiveIntegerField("memory (MB)", default=0)
    health = models.CharField(max_length=16, choices=GPUHealth.choices, default=GPUHealth.HEALTHY)
    # When it last turned healthy; an unhealthy GPU returns to service only after a quarantine.
    healthy_since = models.DateTimeField(null=True, blank=True)
    health_reason = models.CharField(
        max_length=500, blank=True, help_text="Why the agent reports it unhealthy (XID, ECC errors, lost, slowdown)."
    )

    class Meta:
        ordering = ["node", "index"]
        verbose_name = "GPU"
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_unique_index_per_node")]

    def __str__(self) -> str:
        return f"{self.node.name}/gpu{self.index} ({self.gpu_class})"


def gpu_in_service(health: str, healthy_since, now) -> bool:
    """Whether a GPU may hold work: healthy, and past its quarantine if it recovered (DESIGN invariant 5).

    The placer and the cluster summary both ask this, so status cannot call a GPU
    free that the placer would refuse. A null healthy_since means healthy since
    the agent first reported it.
    """
    if health != GPUHealth.HEALTHY:
        return False
    quarantine = timedelta(seconds=settings.LLMGW_GPU_QUARANTINE_SECONDS)
    return healthy_since is None or healthy_since <= now - quarantine


def human_size(size_bytes: int) -> str:
    """A byte count for people, in powers of 1024: `512 B`, `1.5 KiB`, `15.2 GiB`."""
    size = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


class WeightsQuerySet(models.QuerySet):
    def reported_headers(self, sources) -> dict[str, tuple[dict[str, Any], str]]:
        """Per source, the newest header report of its weights and the node that made it: (header JSON, node name).

        One query for any number of sources (rows of other nodes for the same source are read and passed over:
        a source is on a few nodes, not thousands).
        """
        rows = (
            self.filter(source__in=list(sources), header__isnull=False)
            .order_by("source", "-seen_at", "-pk")
            .values_list("source", "header", "node__name")
        )
        found: dict[str, tuple[dict[str, Any], str]] = {}
        for source, header, node in rows:
            found.setdefault(source, (header, node))
        return found


class Weights(models.Model):
    """One source's weights on a node's disk, as its agent last reported them (nodewire/weights/disk.py).

    Rows are written only when what the node reports changes, so `seen_at` is
    when this path, size and header were first reported.
    """

    node = models.ForeignKey(Node, related_name="weights", on_delete=models.CASCADE)
    source = models.CharField(max_length=500, help_text="Hub repository id, or GGUF path relative to the root.")
    path = models.CharField(max_length=1000)
    size_bytes = models.PositiveBigIntegerField("size (bytes)")
    # What the weights' headers say (nodewire.protocol WeightsHeaderFacts as JSON: exact tensor bytes, bytes per
    # dtype, parameters, shape); null when the agent does not say. catalog/sizing.py sizes hub models by it.
    header = models.JSONField(
        null=True, blank=True, help_text="What the weights' headers say of their size and shape, as reported."
    )
    seen_at = models.DateTimeField()
    # Set by the leader's sweep (reconciler.weights.sweep) when it first finds no profile using the weights,
    # cleared when one does again, and set anew when a removal is sent (one that did not take is tried again
    # a grace period later).
    unused_since = models.DateTimeField(
        null=True, blank=True, help_text="Since when no profile uses them (empty: in use, or not swept yet)."
    )
    # Stamped when a replica is placed on the node with them (reconciler.weights.budget): a node over its weights
    # budget evicts the least recently used first.
    last_used = models.DateTimeField(
        null=True, blank=True, help_text="When an engine was last started on them here (empty: not since reported)."
    )

    objects = WeightsQuerySet.as_manager()

    class Meta:
        ordering = ["node", "source"]
        verbose_name_plural = "weights"
        constraints = [models.UniqueConstraint(fields=["node", "source"], name="weights_unique_source_per_node")]

    def __str__(self) -> str:
        return f"{self.source} on {self.node.name}"


class WeightsStage(models.Model):
    """A source's weights being put on a node's disk before an engine needs them (agent/weights/staging.py).

    Written when the control plane sends stage_weights (reconciler.weights.staging) and by each staging_status
    the agent sends back; a replica waits for the stages of its weights (holding no GPU) before it is placed.
    Once the node reports the weights themselves (a Weights row), a ready stage has said all it had to.
    """

    node = models.ForeignKey(Node, related_name="stages", on_delete=models.CASCADE)
    source = models.CharField(max_length=500, help_text="Hub repository id (fetched) or absolute path (checked).")
    revision = models.CharField(max_length=200, default="main")
    state = models.CharField(max_length=16, choices=StagingState.choices, default=StagingState.ASKED)
    bytes_done = models.PositiveBigIntegerField(default=0)
    bytes_total = models.PositiveBigIntegerField(default=0, help_text="0: not known yet.")
    bytes_per_second = models.FloatField(default=0.0)
    message = models.TextField(blank=True, help_text="Why it failed, or how it went.")
    peers = models.JSONField(default=list, blank=True, help_text="The nodes it copies from (empty: from the hub).")
    asked_at = models.DateTimeField(help_text="When stage_weights was (last) sent.")
    updated_at = models.DateTimeField(help_text="The last report from the agent (or the last time it was asked).")
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["node", "source"]
        constraints = [models.UniqueConstraint(fields=["node", "source"], name="weights_stage_unique_source_per_node")]

    def __str__(self) -> str:
        return f"staging {self.source} on {self.node.name}"

    @property
    def seconds_left(self) -> float | None:
        """How long the rest should take at the current rate; None when not known (no rate, no total)."""
        if self.state == StagingState.READY:
            return 0.0
        if self.bytes_per_second <= 0 or not self.bytes_total:
            return None
        return max(0.0, (self.bytes_total - self.bytes_done) / self.bytes_per_second)


class NodeCredentialQuerySet(models.QuerySet["NodeCredential"]):
    def verify(self, node_name: str, token: str):
        """The credential for `node_name` if `token` matches it, else None."""
        cred = self.filter(node__name=node_name).select_related("node").first()
        if cred is None or not secret_matches(cred.token_hash, token):
            return None
        return cred


class NodeCredential(models.Model):
    """The secret a node's agent authenticates with, issued at enrolment (stored hashed)."""

    node = models.OneToOneField(Node, related_name="credential", on_delete=models.CASCADE)
    token_hash = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(max_length=16, help_text="The first characters of the token, to recognise it.")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = NodeCredentialQuerySet.as_manager()

    def __str__(self) -> str:
        return f"{self.node.name} ({self.prefix}…)"

    @staticmethod
    def new_token() -> str:
        return new_secret(TOKEN_PREFIX)
