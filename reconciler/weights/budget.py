"""What a node may remove to stay within its weights budget, and when weights were last used there.

A stage sent to a node carries the weights the node may remove if the new ones would not fit its budget
(agent/weights/budget.py applies it, knowing the sizes): weights no engine on that node runs now (a shard not
stopped or failed), that no profile pins (`prefetch_nodes`), never the source being staged, least recently used
first — the weights no engine was started on since they were reported, then the oldest start. Placement stamps
`Weights.last_used` when it starts a replica on a node holding them. Three queries for any number of nodes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime

from django.db.models import F, Q

from catalog.models import Profile
from inventory.models import Weights
from nodewire.weights.disk import weights_key
from nodewire.weights.staging_messages import Evictable
from reconciler.choices import ShardState
from reconciler.models import Shard


def pinned_keys() -> set[str]:
    """The weights keys profiles keep staged ahead of demand (`prefetch_nodes`); one query."""
    rows = Profile.objects.filter(prefetch_nodes__gt=0).values_list("engine", "model__source")
    return {weights_key(engine, source) for engine, source in rows}


def evictable_on(nodes: Iterable[str]) -> dict[str, list[Evictable]]:
    """Per node, the weights it may remove for a stage, least recently used first (see the module docstring)."""
    nodes = set(nodes)
    if not nodes:
        return {}
    running: dict[str, set[str]] = defaultdict(set)
    shards = Shard.objects.filter(node__name__in=nodes).exclude(state__in=(ShardState.STOPPED, ShardState.FAILED))
    for node, engine, source in shards.values_list("node__name", "replica__profile__engine", "replica__model__source"):
        running[node].add(weights_key(engine, source))
    kept = pinned_keys()
    rows = (
        Weights.objects.filter(node__name__in=nodes)
        .order_by(F("last_used").asc(nulls_first=True), "seen_at", "pk")
        .values_list("node__name", "source", "path")
    )
    found: dict[str, list[Evictable]] = defaultdict(list)
    for node, source, path in rows:
        if not ({source, path} & (running[node] | kept)):
            found[node].append(Evictable(source=source, path=path))
    return dict(found)


def mark_used(placed: Iterable[tuple[int, str]], now: datetime) -> int:
    """Stamp `last_used` on the weights of each (node id, weights key) a replica was just placed on; one UPDATE."""
    pairs = list(placed)
    if not pairs:
        return 0
    where = Q()
    for node_id, key in pairs:
        where |= Q(node_id=node_id) & (Q(source=key) | Q(path=key))
    return Weights.objects.filter(where).update(last_used=now)
