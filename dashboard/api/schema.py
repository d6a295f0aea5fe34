"""OpenAPI generation: drf-spectacular's AutoSchema, plus the error answers every operation can give.

Each operation documents 401 (no or bad credentials) and 403 (not staff);
operations with a path parameter document 404; writes and filtered lists
document 400. Their body is `{"detail": …}`, for 400 also the field at fault.
"""

from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiResponse, inline_serializer
from rest_framework import serializers

ERROR = inline_serializer(
    "Error",
    fields={"detail": serializers.CharField(help_text="What went wrong.")},
)
BAD_REQUEST = OpenApiResponse(
    response={"type": "object", "additionalProperties": True},
    description="Bad input: each key names a field (or `detail`/`errors` for the whole request); nothing changed.",
)


class ApiAutoSchema(AutoSchema):
    """Adds the documented 400/401/403/404 answers to what the serializers say."""

    def _get_response_bodies(self, direction="response"):
        responses = super()._get_response_bodies(direction)
        errors = {
            "401": OpenApiResponse(ERROR, description="No or bad credentials."),
            "403": OpenApiResponse(ERROR, description="The user is not staff."),
        }
        if "{" in self.path:
            errors["404"] = OpenApiResponse(ERROR, description="No such object.")
        if self.method in ("POST", "PUT", "PATCH") or self._filtered():
            errors["400"] = BAD_REQUEST
        for code, response in errors.items():
            if code not in responses:
                responses[code] = self._get_response_for_code(response, code, direction=direction)
        return responses

    def _filtered(self) -> bool:
        # Lists take limit/offset (and maybe filters) whose bad values are a 400.
        return self.method == "GET" and self._is_list_view()
