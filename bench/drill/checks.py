"""What must hold whatever the fault: read straight from the rows and the process table.

* no GPU held by two shards (the unique constraint makes it impossible; the
  drill counts anyway),
* no profile with more wanted replicas than its max,
* no orphan engine: every mock engine process the drill's agents started
  serves a port some shard row holds.
"""

from __future__ import annotations

import time
from pathlib import Path

from django.db import connection
from django.db.models import Count, F, Q

from catalog.models import Profile
from reconciler.choices import WANTED_STATES
from reconciler.models import GPUAssignment, Shard


def double_placements() -> int:
    """GPUs with more than one awake shard (sleepers may stack: DESIGN invariant 2)."""
    return GPUAssignment.objects.filter(awake=True).values("gpu_id").annotate(n=Count("id")).filter(n__gt=1).count()


def replicas_above_max() -> int:
    wanted = Count("replicas", filter=Q(replicas__state__in=WANTED_STATES))
    return Profile.objects.annotate(wanted=wanted).filter(wanted__gt=F("max_replicas")).count()


def engine_ports(var_dir: Path) -> dict[int, int]:
    """Mock engines started for this drill (by their environment): port → pid."""
    engines = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"mockengine" in argv and f"LLMGW_HOME={var_dir}".encode() in environ:
            port = argv[argv.index(b"--port") + 1]
            engines[int(port)] = int(entry.name)
    return engines


def orphan_engines(var_dir: Path) -> list[int]:
    """Ports of drill engines that no shard row holds."""
    held = set(Shard.objects.values_list("port", flat=True))
    return sorted(port for port in engine_ports(var_dir) if port not in held)


def lasting_orphans(var_dir: Path, grace: float = 5.0) -> list[int]:
    """Orphans still running `grace` seconds later: an engine whose replica just failed is stopped
    by the next command, which is not an orphan yet."""
    first = set(orphan_engines(var_dir))
    if not first:
        return []
    time.sleep(grace)
    return sorted(first & set(orphan_engines(var_dir)))


def invariants(var_dir: Path) -> dict[str, int]:
    """The three counts that must stay 0; the database connection is renewed if a fault broke it."""
    try:
        return {
            "double": double_placements(),
            "above_max": replicas_above_max(),
            "orphans": len(lasting_orphans(var_dir)),
        }
    finally:
        connection.close_if_unusable_or_obsolete()
