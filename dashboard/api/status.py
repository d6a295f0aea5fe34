"""The OpenAPI shape of GET /api/v1/status, derived from the typed summary (`dashboard.summary_types`).

The view answers `ClusterSummary.as_json()`; this serializer is generated
from the same dataclasses, so the schema cannot drift from the answer (the
schemathesis test checks every response against it).
"""

from rest_framework_dataclasses.serializers import DataclassSerializer

from dashboard.summary_types import ClusterSummary


class StatusSerializer(DataclassSerializer):
    """The cluster summary: the same data as `ctl_status`, the dashboard and the fleet metrics."""

    class Meta:
        dataclass = ClusterSummary
