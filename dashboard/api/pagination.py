"""Bounded limit/offset pagination: a `limit` or `offset` out of range is a 400 naming it, never a 500."""

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination

MAX_LIMIT = 1000
# Far beyond any table here, and inside every database's integer range.
MAX_OFFSET = 1_000_000_000


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    """`?limit=` 1..1000 (default 100), `?offset=` 0..1e9; the schema states the same bounds."""

    max_limit = MAX_LIMIT

    def get_limit(self, request):
        return self._bounded(request, self.limit_query_param, 1, MAX_LIMIT, self.default_limit)

    def get_offset(self, request):
        return self._bounded(request, self.offset_query_param, 0, MAX_OFFSET, 0)

    @staticmethod
    def _bounded(request, name: str, low: int, high: int, default):
        text = request.query_params.get(name)
        if text is None:
            return default
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise ValidationError({name: f"{text!r} is not an integer from {low} to {high}."})
        return value

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        bounds = {self.limit_query_param: (1, MAX_LIMIT), self.offset_query_param: (0, MAX_OFFSET)}
        for parameter in parameters:
            low, high = bounds[parameter["name"]]
            parameter["schema"].update(minimum=low, maximum=high)
        return parameters
