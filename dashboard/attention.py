"""What an operator should look at, read off the cluster summary: the rule behind `ctl_status --check`."""

from dashboard.summary_types import ClusterSummary


def needs_attention(s: ClusterSummary) -> list[str]:
    """What an operator should look at, one short phrase each; empty when all is well.

    The `ctl_status --check` rule: no leader or an expired lease (nothing is
    reconciled), the partition brake, unreachable nodes, unhealthy GPUs,
    models that cannot be placed without an operator, failed replicas, and
    unknown usage (idle stops and evictions are paused). Cordoned and lost
    nodes are not listed: an operator or the tick has already acted on them.
    """
    problems = []
    leader = s.leader
    if leader is None:
        problems.append("no leader")
    elif leader.expires_in_seconds < 0:
        problems.append(f"leader lease expired {-leader.expires_in_seconds:.0f}s ago")
    if s.partition_brake.engaged:
        problems.append("partition brake engaged")
    if s.nodes.unreachable:
        problems.append(f"{s.nodes.unreachable} unreachable nodes")
    unhealthy = sum(row.unhealthy for row in s.capacity)
    if unhealthy:
        problems.append(f"{unhealthy} unhealthy GPUs")
    if s.unplaceable_models:
        names = s.unplaceable_models
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        problems.append(f"{len(names)} unplaceable models ({shown})")
    if s.replicas.failed:
        problems.append(f"{s.replicas.failed} failed replicas")
    if not s.usage.known:
        problems.append(f"usage unknown ({s.usage.reason})")
    return problems
