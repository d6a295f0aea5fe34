"""What the /admin index (the cluster dashboard) shows, built from the one cluster summary."""

from reconciler.idle import Idle

from .summary import cluster_summary

REFRESH_SECONDS = 10
STOPPABLE_SHOWN = 10
"""Stop candidates the panel lists; the rest are counted (ctl_status --all lists them)."""


def _percent(part: int, total: int) -> float:
    return round(100.0 * part / total, 2) if total else 0.0


def dashboard_context(summary: dict | None = None) -> dict:
    """Template context for the dashboard: the summary plus bar widths and idle text.

    Only presentation is added here; every figure comes from `cluster_summary()`
    (DESIGN invariant 6).
    """
    summary = summary if summary is not None else cluster_summary()
    capacity = [
        {
            **row,
            "bar": [
                (state, _percent(row[state], row["total"]))
                for state in ("used", "unhealthy", "unavailable", "free")
                if row[state]
            ],
        }
        for row in summary["capacity"]
    ]
    replicas = [{**r, "idle": str(Idle.from_json(r["idle_seconds"], r["idle_known"]))} for r in summary["replica_list"]]
    stoppable = summary["stoppable"]
    return {
        "summary": summary,
        "capacity": capacity,
        "replica_rows": replicas,
        "stoppable": stoppable[:STOPPABLE_SHOWN],
        "stoppable_more": max(0, len(stoppable) - STOPPABLE_SHOWN),
        "idle_held_classes": [row for row in summary["idle_held_gpus"]["by_class"] if row["gpus"]],
        "refresh_seconds": REFRESH_SECONDS,
    }
