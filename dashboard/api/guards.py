"""Input every endpoint refuses before it reaches a query: NUL characters, which PostgreSQL cannot store or compare."""

from typing import Any

from rest_framework.exceptions import ValidationError


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


class RefuseNulMixin:
    """A view mixin: a NUL character in the path, the query or the JSON body is a 400 naming where, on any database."""

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        for where, value in (("path", kwargs), ("query", dict(request.query_params.lists()))):
            if _has_nul(value):
                raise ValidationError({"detail": f"the {where} contains a NUL character"})
        if request.method in ("POST", "PUT", "PATCH") and _has_nul(request.data):
            raise ValidationError({"detail": "the body contains a NUL character"})
