"""What each model's users felt over the routers' last window, for the cluster summary (`ClusterSummary.felt`).

The tick records it on each model's `ModelLoad` row (reconciler.demand.objectives): p90 time to first token and
gap between tokens, the share within the first profile's objectives, the pressure objective scaling acts on, the
fair queues per class and the tokens each team was served through them with its weight; and its replicas parked
out of rotation (reconciler.demand.spares). Read here in one query,
the objectives taken from the model's first profile in the same query.
"""

from django.db.models import Count, OuterRef, Q, Subquery

from catalog.models import Profile
from dashboard.summary_types import ModelFelt, QueueClass, TeamShare
from hub.priority import RANKS
from reconciler.models import ModelLoad

_FIGURES = ("ttft_p90", "itl_p90", "ttft_attained", "itl_attained", "pressure")


def models_felt() -> list[ModelFelt]:
    """Every model with something in the routers' window, the most pressed first (then the most waiting). One query."""
    first = Profile.objects.filter(model=OuterRef("model")).order_by("order", "id")
    rows = (
        ModelLoad.objects.exclude(Q(ttft_p90=None) & Q(itl_p90=None) & Q(pressure=None) & Q(queue={}) & Q(served={}))
        .annotate(
            ttft_objective=Subquery(first.values("ttft_objective_seconds")[:1]),
            itl_objective=Subquery(first.values("itl_objective_seconds")[:1]),
            parked=Count("model__replicas", filter=Q(model__replicas__parked_since__isnull=False)),
        )
        .values_list("model__name", *_FIGURES, "ttft_objective", "itl_objective", "queue", "served", "parked")
    )
    felt = [_felt(*row) for row in rows]
    felt.sort(key=lambda m: (-(m.pressure or 0.0), -m.waiting, m.model))
    return felt


def _felt(
    model, ttft, itl, ttft_attained, itl_attained, pressure, ttft_objective, itl_objective, queue, served, parked
):
    classes = sorted(queue.items(), key=lambda item: RANKS.get(item[0], len(RANKS)))
    total = sum(figures["tokens"] for figures in served.values())
    weights = sum(figures["weight"] for figures in served.values())
    shares = [
        TeamShare(team, figures["tokens"], figures["tokens"] / total, figures["weight"], figures["weight"] / weights)
        for team, figures in sorted(served.items(), key=lambda item: (-item[1]["tokens"], item[0]))
    ] if total else []  # fmt: skip
    return ModelFelt(
        model=model,
        ttft_p90_seconds=ttft,
        ttft_objective_seconds=ttft_objective,
        ttft_attained=ttft_attained,
        itl_p90_seconds=itl,
        itl_objective_seconds=itl_objective,
        itl_attained=itl_attained,
        pressure=pressure,
        parked=parked,
        queue=[QueueClass(name, int(f.get("waiting", 0)), f.get("wait_p90")) for name, f in classes],
        shares=shares,
    )
