"""GET /api/v1/showback?month=YYYY-MM: each team's share of a UTC month's GPU-hours (keys.showback), per model.

Operators see every team, keys of no team and the idle time; anyone else signed in sees the teams they belong to
(teams.access), and no idle time or total, which are the fleet's.
"""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from dashboard.api.schema import BAD_REQUEST
from keys.showback import month_bounds, showback
from teams.access import is_operator, visible_teams

MONTH = "^2[0-9]{3}-(0[1-9]|1[0-2])$"  # keys.showback.month_bounds


class ShowbackRowSerializer(serializers.Serializer):
    """A team's GPU-hours on one model, and the tokens its keys were served there."""

    team = serializers.CharField(allow_null=True, help_text="The team; null: keys of no team.")
    model = serializers.CharField()
    gpu_hours = serializers.FloatField()
    tokens = serializers.IntegerField()


class IdleSerializer(serializers.Serializer):
    """A model's GPU-hours in replicas' hours that served no tokens."""

    model = serializers.CharField()
    gpu_hours = serializers.FloatField()


class ShowbackSerializer(serializers.Serializer):
    """A month's GPU time, attributed per team and model by each replica's tokens."""

    month = serializers.CharField(help_text="YYYY-MM (UTC).")
    teams = ShowbackRowSerializer(many=True)
    idle = IdleSerializer(many=True, help_text="Operators only (empty for others).")
    total_gpu_hours = serializers.FloatField(allow_null=True, help_text="Every GPU-hour of the month; operators only.")


class ShowbackView(APIView):
    """GET /api/v1/showback: a month's showback, as much of it as the asker may see."""

    permission_classes = [IsAuthenticated]

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "month", {"type": "string", "pattern": MONTH}, description="YYYY-MM (UTC); default: this month, so far."
            )
        ],
        responses={200: ShowbackSerializer, 400: BAD_REQUEST},
    )
    def get(self, request: Request) -> Response:
        try:
            start, end = month_bounds(request.query_params.get("month"), timezone.now())
        except ValueError as exc:
            raise ValidationError({"month": [str(exc)]}) from None
        operator = is_operator(request.user)
        teams = None if operator else list(visible_teams(request.user).values_list("pk", flat=True))
        report = showback(start, end, teams)
        rows = [
            {"team": row.team, "model": row.model, "gpu_hours": row.gpu_seconds / 3600, "tokens": row.tokens}
            for row in report.rows
        ]
        idle = [{"model": model, "gpu_hours": seconds / 3600} for model, seconds in report.idle.items()]
        total = report.total_seconds / 3600 if operator else None
        return Response({"month": f"{start:%Y-%m}", "teams": rows, "idle": idle, "total_gpu_hours": total})
