"""Prefetch: a profile's weights kept staged on `prefetch_nodes` nodes of its GPU class ahead of demand.

With the tick's `stages` step (every quarter of LLMGW_STAGE_STALL_SECONDS), for each profile whose engine is
staged (LLMGW_STAGE_ENGINES) and that sets `prefetch_nodes`: the ready nodes of its class whose agents can
stage, holding its weights (reported, or a ready stage) or staging them, are counted; while fewer than it asks
for (or than the class has), more are asked, by name, with peers to copy from as any stage
(reconciler.weights.staging). A node whose stage of them failed within the hour is not asked again before. The
weights of a profile are never swept (a profile uses them), and prefetched ones are pinned against a weights
budget's eviction (reconciler.weights.budget). Four queries, and those of the stages it asks for.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta

from django.db.models import Q

from catalog.models import Profile
from inventory.choices import NodeState, StagingState
from inventory.models import Node, Weights, WeightsStage
from reconciler.outbox import Outbox
from reconciler.weights.staging import Stages, key_of, resend_stalled, revision_of, stageable

RETRY_FAILED_AFTER = timedelta(hours=1)


def tend_stages(now: datetime, outbox: Outbox) -> int:
    """The tick's `stages` step: stages gone quiet asked for again, then the prefetches still lacking; returns how
    many stages were asked for."""
    return resend_stalled(now, outbox) + prefetch(now, outbox)


def prefetch(now: datetime, outbox: Outbox) -> int:
    """Ask for the stages prefetching profiles still lack; returns how many were asked."""
    profiles = [p for p in Profile.objects.filter(prefetch_nodes__isnull=False).select_related("model") if stageable(p)]
    if not profiles:
        return 0
    keys = {key_of(p) for p in profiles}
    by_class: dict[str, list[str]] = defaultdict(list)
    nodes = Node.objects.filter(stages_weights=True, state=NodeState.READY, schedulable=True)
    for name, gpu_class in (
        nodes.filter(gpus__gpu_class__in={p.gpu_class for p in profiles})
        .values_list("name", "gpus__gpu_class")
        .distinct()
        .order_by("name")
    ):
        by_class[gpu_class].append(name)
    holding: dict[str, set[str]] = defaultdict(set)  # source -> nodes holding or staging it
    failed: dict[str, set[str]] = defaultdict(set)  # source -> nodes whose stage of it failed within the hour
    for source, path, node in Weights.objects.filter(Q(source__in=keys) | Q(path__in=keys)).values_list(
        "source", "path", "node__name"
    ):
        holding[source].add(node)
        holding[path].add(node)
    recent_failure = Q(state=StagingState.FAILED) & Q(finished_at__gte=now - RETRY_FAILED_AFTER)
    stages_rows = WeightsStage.objects.filter(
        Q(state__in=(StagingState.ASKED, StagingState.FETCHING, StagingState.READY)) | recent_failure, source__in=keys
    )
    for source, node, state in stages_rows.values_list("source", "node__name", "state"):
        (failed if state == StagingState.FAILED else holding)[source].add(node)
    stages = Stages.of(keys)
    for profile in profiles:
        key, candidates = key_of(profile), by_class[profile.gpu_class]
        have = [n for n in candidates if n in holding[key]]
        want = min(profile.prefetch_nodes or 0, len(candidates)) - len(have)
        lacking = [n for n in candidates if n not in holding[key] and n not in failed[key]][: max(0, want)]
        if lacking:
            stages.ask(key, revision_of(profile), lacking, frozenset(holding[key]), outbox)
            holding[key].update(lacking)
    stages.write(now, outbox)
    return len(stages.asked)
