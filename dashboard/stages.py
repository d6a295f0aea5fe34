"""Weights being staged on the nodes, for the cluster summary (`ClusterSummary.staging`).

Read from `inventory.WeightsStage` (reconciler.weights.staging asks, the agents report): the stages under way,
and those that ended (ready or failed) within the last hour, so an operator sees what just happened too. One
query; under way first, the least done first, then the newest ended.
"""

from datetime import datetime, timedelta

from django.db.models import Q

from dashboard.summary_types import StageStatus
from inventory.choices import STAGING_UNDER_WAY
from inventory.models import WeightsStage

RECENT = timedelta(hours=1)


def stages(now: datetime) -> list[StageStatus]:
    """Stages under way and those ended in the last hour. One query."""
    rows = WeightsStage.objects.filter(Q(state__in=STAGING_UNDER_WAY) | Q(finished_at__gte=now - RECENT))
    found = [
        StageStatus(
            node=row.node.name,
            source=row.source,
            state=row.state,
            bytes_done=row.bytes_done,
            bytes_total=row.bytes_total,
            bytes_per_second=row.bytes_per_second,
            seconds_left=row.seconds_left if row.state in STAGING_UNDER_WAY else None,
            message=row.message,
            updated_at=row.updated_at.isoformat(),
        )
        for row in rows.select_related("node")
    ]
    under_way = [s for s in found if s.state in STAGING_UNDER_WAY]
    ended = [s for s in found if s.state not in STAGING_UNDER_WAY]
    under_way.sort(key=lambda s: (s.fraction or 0.0, s.node, s.source))
    ended.sort(key=lambda s: s.updated_at, reverse=True)
    return under_way + ended
