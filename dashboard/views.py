"""What the /admin index (the cluster dashboard) shows, and the panels-only fragment its fetch loop swaps in."""

from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from dashboard.panels import humanize_ago, humanize_duration, panel_extras
from dashboard.summary import cluster_summary
from dashboard.summary_types import ClusterSummary
from reconciler.choices import ReplicaState

REFRESH_SECONDS = 5
"""How often the page's fetch loop asks for fresh panels."""
STOPPABLE_SHOWN = 10
"""Stop candidates the panel lists; the rest are counted (ctl_status --all lists them)."""
REPLICAS_SHOWN = 50
"""Replica rows the panel lists, those not ready first; the rest are counted (the Replicas admin lists them).
Every row would make the fragment a megabyte on a 1,000-node fleet, fetched every few seconds."""
LEGEND = (("used", "#"), ("unhealthy", "!"), ("unavailable", "x"), ("free", "-"))
"""Capacity bar states in drawing order, with the character ctl_status draws each with."""


def _percent(part: int, total: int) -> float:
    return round(100.0 * part / total, 2) if total else 0.0


def dashboard_context(summary: ClusterSummary | None = None) -> dict:
    """Template context for the panels: the summary plus bar widths, human times and the extra panels.

    Only presentation is added here and in `panels.panel_extras`; every fleet
    figure comes from `cluster_summary()` (DESIGN invariant 6). Rows the
    templates show with extra text are pairs of the summary's row and that text.
    """
    now = timezone.now()
    summary = summary if summary is not None else cluster_summary(now)
    capacity = [
        {
            "row": row,
            "bar": [(state, _percent(getattr(row, state), row.total)) for state, _ in LEGEND if getattr(row, state)],
        }
        for row in summary.capacity
    ]
    # Stable sort: what needs a look (pending, starting, failed, stopping) first, each group by id.
    ordered = sorted(summary.replica_list, key=lambda r: r.state == ReplicaState.READY)
    replicas = [
        {
            "row": r,
            "idle_human": humanize_duration(r.idle.seconds),
            "ready_ago": humanize_ago(r.ready_at, now),
            "used_ago": humanize_ago(r.last_used, now),
        }
        for r in ordered
    ]
    stoppable = [{"row": e, "idle_human": humanize_duration(e.idle_seconds)} for e in summary.stoppable]
    return {
        "summary": summary,
        "capacity": capacity,
        "legend": LEGEND,
        "replica_rows": replicas[:REPLICAS_SHOWN],
        "replicas_more": max(0, len(replicas) - REPLICAS_SHOWN),
        "stoppable": stoppable[:STOPPABLE_SHOWN],
        "stoppable_more": max(0, len(stoppable) - STOPPABLE_SHOWN),
        "idle_held_classes": [row for row in summary.idle_held_gpus.by_class if row.gpus],
        "refresh_seconds": REFRESH_SECONDS,
        **panel_extras(summary, now),
    }


@require_GET
@never_cache
def panels_view(request: HttpRequest) -> HttpResponse:
    """The dashboard panels alone, as an HTML fragment (staff only: wrapped in `admin_view` by the site)."""
    return TemplateResponse(request, "dashboard/panels.html", dashboard_context())
