"""Reconciler models: Replica, Shard, GPUAssignment, AdapterLoad (and AdapterStats) and the leader Lease."""

from django.db import models
from django.utils import timezone

from reconciler.choices import AdapterLoadState, Hold, ReplicaState, ShardState
from reconciler.demand.idle import Idle


class ReplicaQuerySet(models.QuerySet):
    def ready(self):
        return self.filter(state=ReplicaState.READY)

    def holding(self):
        """Replicas whose requests routers keep holding while room is made or nodes report in."""
        return self.exclude(hold=Hold.NONE)

    def not_holding(self):
        return self.filter(hold=Hold.NONE)


class Replica(models.Model):
    """One running (or wanted) copy of a model under one profile.

    `last_used` is null when unknown (DESIGN invariant 3): never treat null as idle.
    """

    model = models.ForeignKey("catalog.Model", related_name="replicas", on_delete=models.CASCADE)
    profile = models.ForeignKey("catalog.Profile", related_name="replicas", on_delete=models.CASCADE)
    state = models.CharField(max_length=16, choices=ReplicaState.choices, default=ReplicaState.PENDING)
    endpoint_url = models.CharField(max_length=255, blank=True)
    placement_note = models.TextField(
        blank=True, help_text="Why the last placement attempt found no room, for operators."
    )
    # Set with placement_note by the placer; queried by value, the text is for operators.
    hold = models.CharField(
        max_length=20,
        choices=Hold.choices,
        default=Hold.NONE,
        blank=True,
        help_text="Why routers keep holding its requests although it found no room (empty: not holding).",
    )
    last_error = models.TextField(blank=True)
    failure_count = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    epoch = models.BigIntegerField(default=0, help_text="Lease epoch of the leader that placed it.")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    last_used = models.DateTimeField(null=True, blank=True)
    demand_until = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Created for waiting requests: withdrawn if still unplaced after this (renewed while they wait).",
    )
    stopping_since = models.DateTimeField(null=True, blank=True)
    # The hibernate tier (reconciler.hibernate.tier): when it was asked to sleep, at which level, and why.
    sleeping_since = models.DateTimeField(null=True, blank=True)
    sleep_level = models.PositiveSmallIntegerField(
        null=True,
        blank=True,
        help_text="The best level its engine was started able to sleep at (empty: it cannot; it is stopped instead).",
    )
    sleeping_level = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="The level of its current sleep (level 1 holds its weights in host memory)."
    )
    wanted_since = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Since when it has been wanted and waited: asleep, to be woken (requests or min replicas); "
        "pending, to be placed (the first tick it found no room). Cleared once woken or placed.",
    )
    source = models.CharField(
        max_length=500,
        blank=True,
        editable=False,
        help_text="The source its engine was started from (its model's when placed): those weights stay in use while "
        "it runs, even if the model's source is edited since.",
    )
    weights_bytes = models.BigIntegerField(
        null=True, blank=True, help_text="Its weights' estimated size when placed: host memory a level-1 sleep holds."
    )
    pools = models.JSONField(
        default=list,
        blank=True,
        help_text="Created for requests of a key bound to these pools: placed only on a profile in one of them "
        "(empty: on any of its model's profiles).",
    )
    gpu_time_until = models.DateTimeField(
        null=True, blank=True, editable=False, help_text="Until when its GPU time is counted (keys.GpuHour)."
    )
    stop_reason = models.CharField(max_length=200, blank=True, help_text="Why it is being stopped.")
    # Make-before-break node drain (reconciler.lifecycle.drain): this replica keeps serving until `replaced_by`
    # is ready, then is drained; at `drain_deadline` at the latest.
    replaced_by = models.ForeignKey(
        "self", null=True, blank=True, related_name="replacing", on_delete=models.SET_NULL, editable=False
    )
    drain_deadline = models.DateTimeField(
        null=True, blank=True, help_text="A node drain stops it once its replacement is ready, or at this time."
    )
    parked_since = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Out of rotation since then: its model meets its latency objectives with fewer replicas, so "
        "routers send it requests only when the others cannot take them, and the idle timeout stops it "
        "(reconciler.demand.spares).",
    )

    objects = ReplicaQuerySet.as_manager()

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"replica {self.pk} of {self.model.name}"

    def idle(self, now=None) -> Idle:
        """How long since last use; unknown when last_used is null (never 0 for unknown)."""
        return Idle.since(self.last_used, now or timezone.now())


class Shard(models.Model):
    """The part of a replica that runs on one node (rank 0 is the head)."""

    replica = models.ForeignKey(Replica, related_name="shards", on_delete=models.CASCADE)
    node = models.ForeignKey("inventory.Node", related_name="shards", on_delete=models.CASCADE)
    rank = models.PositiveSmallIntegerField(default=0)
    port = models.PositiveIntegerField()
    state = models.CharField(max_length=16, choices=ShardState.choices, default=ShardState.ASSIGNED)
    message = models.TextField(blank=True)
    running = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Requests the engine holds (running or queued), from the last heartbeat (empty: unknown).",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["replica", "rank"]
        constraints = [
            models.UniqueConstraint(fields=["replica", "rank"], name="shard_unique_rank_per_replica"),
            models.UniqueConstraint(fields=["node", "port"], name="shard_unique_port_per_node"),
        ]

    def __str__(self) -> str:
        return f"shard {self.pk} (replica {self.replica_id} rank {self.rank} on {self.node.name}:{self.port})"


class GPUAssignment(models.Model):
    """A GPU held by a shard: awake (the GPU's memory is its engine's), or asleep (only its engine's context).

    The partial unique constraint is DESIGN invariant 2: at most one awake
    shard per GPU, whoever writes, so not even two leaders can double-book a
    GPU; sleepers may stack on it. A shard is awake from placement until its
    engine reports it has gone to sleep, and again from the moment a wake is
    decided (before the command is sent), so a wake can never race a placement.
    """

    gpu = models.ForeignKey("inventory.GPU", related_name="assignments", on_delete=models.CASCADE)
    shard = models.ForeignKey(Shard, related_name="gpu_assignments", on_delete=models.CASCADE)
    awake = models.BooleanField(default=True)

    class Meta:
        verbose_name = "GPU assignment"
        constraints = [
            models.UniqueConstraint(
                fields=["gpu"], condition=models.Q(awake=True), name="gpu_has_at_most_one_awake_shard"
            ),
            models.UniqueConstraint(fields=["gpu", "shard"], name="gpu_held_once_per_shard"),
        ]

    def __str__(self) -> str:
        return f"GPU {self.gpu_id} → shard {self.shard_id}"


class AdapterLoad(models.Model):
    """A LoRA adapter the leader put on one replica of its base: loading, loaded, or being unloaded.

    Written by reconciler.adapters; a replica holds at most its profile's `max_adapters` loading or loaded.
    `last_used` is the routers' last use of the adapter on this replica (null: not used since it loaded).
    """

    adapter = models.ForeignKey("catalog.Adapter", related_name="loads", on_delete=models.CASCADE)
    replica = models.ForeignKey(Replica, related_name="adapter_loads", on_delete=models.CASCADE)
    state = models.CharField(max_length=16, choices=AdapterLoadState.choices, default=AdapterLoadState.LOADING)
    requested_at = models.DateTimeField(help_text="When the load (or, unloading, the unload) was sent.")
    loaded_at = models.DateTimeField(null=True, blank=True)
    last_used = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["replica", "adapter"]
        constraints = [models.UniqueConstraint(fields=["adapter", "replica"], name="adapter_load_once_per_replica")]

    def __str__(self) -> str:
        return f"adapter {self.adapter_id} on replica {self.replica_id} ({self.state})"


class AdapterStats(models.Model):
    """LoRA adapter loads on one base model's replicas as the agents answered them, counted by the control plane.

    Counters for operators (`llmgw_adapter_loads_total`, `_load_failures_total`) and the learned time a load
    takes (a moving average of what the agents timed).
    """

    model = models.OneToOneField("catalog.Model", related_name="adapter_stats", on_delete=models.CASCADE)
    loads = models.PositiveBigIntegerField(default=0)
    failures = models.PositiveBigIntegerField(default=0)
    load_seconds = models.FloatField(null=True, blank=True)

    def __str__(self) -> str:
        return f"adapter loads on {self.model_id}: {self.loads} ({self.failures} failed)"


class BusyPort(models.Model):
    """An engine port an agent found taken by something else on its node's host.

    The placer gives it to no shard on that host until `until`, so a port held
    by a stranger costs one failed start, not one per retry.
    """

    node = models.ForeignKey("inventory.Node", related_name="busy_ports", on_delete=models.CASCADE)
    port = models.PositiveIntegerField()
    until = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "port"], name="busy_port_unique_per_node")]

    def __str__(self) -> str:
        return f"port {self.port} busy on {self.node.name}"


class ModelLoad(models.Model):
    """Requests in flight for a model, summed over the routers' last reports, and since when it is over target;
    what its users felt over the routers' windows (reconciler.demand.objectives).

    Written by the tick; `busy_since` is set while the in-flight count per ready
    replica is above the primary profile's target concurrency (with latency
    objectives: while it is over them, reconciler.demand.objectives), so
    scale-out waits until the load has lasted (LLMGW_SCALE_OUT_AFTER_SECONDS).
    """

    model = models.OneToOneField("catalog.Model", related_name="load", on_delete=models.CASCADE)
    in_flight = models.PositiveIntegerField(default=0)
    busy_since = models.DateTimeField(null=True, blank=True)
    calm_since = models.DateTimeField(
        null=True, blank=True, help_text="Since when its pressure is at or below LLMGW_OBJECTIVE_SCALE_DOWN."
    )
    trend = models.JSONField(
        default=list, blank=True, help_text="[Unix time, streams begun in the window] over the last window."
    )
    ttft_p90 = models.FloatField(null=True, blank=True, help_text="p90 time to first token over the window (s).")
    itl_p90 = models.FloatField(null=True, blank=True, help_text="p90 gap between tokens over the window (s).")
    ttft_attained = models.FloatField(
        null=True, blank=True, help_text="Share of first tokens within the primary profile's objective."
    )
    itl_attained = models.FloatField(null=True, blank=True, help_text="Share of gaps within the objective.")
    pressure = models.FloatField(
        null=True, blank=True, help_text="The worst p90 over its objective, replicas still starting discounted."
    )
    queue = models.JSONField(
        default=dict, blank=True, help_text="Class -> {waiting now, p90 wait (s) over the window} in the routers."
    )
    served = models.JSONField(
        default=dict,
        blank=True,
        help_text="Team -> {tokens served through the fair queue over the window, its weight}.",
    )

    def __str__(self) -> str:
        return f"load of {self.model.name}: {self.in_flight} in flight"


class UsageWatch(models.Model):
    """Whether the fleet's usage is known now, and since when (one row, written by the tick).

    Idleness is known only while every tick collected usage and every live
    router's watch mark held, for at least one mark lifetime: otherwise it is
    unknown (DESIGN invariant 3), nothing is stopped for idleness or evicted,
    and `reason` says why.
    """

    name = models.CharField(max_length=64, primary_key=True)
    known_since = models.DateTimeField(null=True, blank=True)
    reason = models.TextField(blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"usage {'known since ' + str(self.known_since) if self.known_since else 'unknown'}"


class Lease(models.Model):
    """The leader lease row (DESIGN invariant 1). Written only by reconciler.leadership.lease.

    `expires_at` is seconds since the Unix epoch by the database's clock.
    """

    name = models.CharField(max_length=64, primary_key=True)
    owner = models.CharField(max_length=64)
    epoch = models.BigIntegerField(default=1)
    expires_at = models.FloatField()

    def __str__(self) -> str:
        return f"{self.name} held by {self.owner} (epoch {self.epoch})"


class PendingCommand(models.Model):
    """An agent command sent and not yet acknowledged: the tick sends it again until the agent answers.

        One per (node, shard, subject): a newer command for the same shard replaces the
        older one (a stop supersedes the start it follows), so what is re-sent is
        only ever the latest decision; adapter commands are per adapter on the shard, and a node's
    remove_weights per source (shard 0, reconciler.outbox.pending_key). `payload` is the command as sent, epoch and
        `cid` included, so a re-sent copy is the same command and a leader's
        successor's agents refuse it (and acknowledge the refusal).
    """

    node_name = models.CharField(max_length=64)
    shard_id = models.BigIntegerField()
    # What on the shard the command is about beyond the shard itself: an adapter's name ("": the shard);
    # for a node's remove_weights (shard 0), "weights:" and the source (up to 500 characters).
    subject = models.CharField(max_length=600, blank=True, default="", db_default="")
    cid = models.CharField(max_length=64, unique=True)
    kind = models.CharField(max_length=16)
    payload = models.JSONField()
    attempts = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField()
    due_at = models.DateTimeField(db_index=True, help_text="When it is sent again if still unacknowledged.")

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["node_name", "shard_id", "subject"], name="pending_command_one_per_shard_subject"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.cid} for shard {self.shard_id} on {self.node_name}"
