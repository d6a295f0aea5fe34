"""OpenAPI generation: drf-spectacular's AutoSchema, plus the error answers every operation can give.

Each operation documents 401 (no or bad credentials) and 403 (not staff);
operations with a path parameter document 404; writes and filtered lists
document 400. Their body is `{"detail": …}`, for 400 also the field at fault.
A body the schema allows is taken, except by the model writes and the plan,
whose 400s also say the catalog's rules that OpenAPI cannot state (fields
judged against each other and against the rest of the catalog), and by the
key and budget writes, whose rows must exist and be the asker's: those are
listed in their 400's description.
"""

from typing import Any

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


CATALOG_RULES = (
    "Besides what the schema states, the catalog's rules (`catalog apply`'s): max_replicas >= min_replicas; "
    "a name or alias not already a model's, an alias's or an adapter's name or alias, and no alias equal to its "
    "model's own name; parameters_billions and dtype given together or neither; sizes within what a model can be; "
    "engine args and env that their engine and the agent take (env names of letters, digits and _, not starting "
    "with a digit, not one the agent sets itself); sleep levels the engine supports; at most as many GPUs per "
    "node as a node has; adapters only on a model with a profile that takes them (max_adapters), of a rank that "
    "fits its max_adapter_rank."
)
MODEL_WRITE_ERROR = inline_serializer(
    "ModelWriteError",
    fields={
        "detail": serializers.CharField(help_text="Every problem, in one line."),
        "errors": serializers.ListField(
            child=serializers.CharField(),
            required=False,
            help_text="Each problem, starting with the field at fault, e.g. `profiles[0].max_replicas: …` "
            "(absent when the body could not be read: not JSON, or holding a NUL).",
        ),
    },
)
MODEL_WRITE_REFUSED = OpenApiResponse(
    MODEL_WRITE_ERROR,
    description=f"Refused; nothing changed. {CATALOG_RULES} PUT and PATCH: `name`, if given, is the model's own "
    "(a model cannot be renamed).",
)
KEY_REFUSED = OpenApiResponse(
    response={"type": "object", "additionalProperties": True},
    description="Refused; nothing changed (the key names the field at fault, or `detail`). `team` must be an "
    "existing team's id, one of the asker's unless an operator asks (403 for a team of someone else's); the "
    "key's models must be within the team's, and a key of someone who is not an operator needs a team.",
)
BUDGET_REFUSED = OpenApiResponse(
    response={"type": "object", "additionalProperties": True},
    description="Refused; nothing changed (the key names the field at fault, or `detail`). A budget has one scope: "
    "`key` alone, `team` with a `user` who is a member of it, or `team` alone; a `timezone` that exists (e.g. "
    "Europe/Paris); one budget per scope and `window`; `key`, `team` and `user` ids of existing rows. Someone who "
    "is not an operator sets budgets only in the teams they administer: 403 naming `team` or `key` otherwise.",
)
PLAN_REFUSED = OpenApiResponse(
    response={"type": "object", "additionalProperties": True},
    description="Refused: the key names the part at fault (`models`, `names` or `detail`). `names` must be "
    "catalog models or aliases; `models` entries are catalog entries (the body of POST /api/v1/models/), "
    f"judged as a catalog file's. {CATALOG_RULES}",
)


# No input may hold a NUL (guards.RefuseNulMixin: PostgreSQL can store none), so every input string says so.
NO_NUL = "^[^\\x00]*$"
# The route patterns of `{name}`/`{id}` path parameters, as they read without a NUL.
_PATH_PATTERNS = {"^[\\s\\S]+$": "^[^\\x00]+$", "^[^/]+$": "^[^/\\x00]+$"}


def _say_no_nul(schema: Any) -> None:
    if not isinstance(schema, dict):
        return
    if schema.get("type") == "string" and not ({"enum", "format"} & schema.keys()):
        pattern = schema.get("pattern")
        if pattern is None:
            schema["pattern"] = NO_NUL
        elif pattern in _PATH_PATTERNS:
            schema["pattern"] = _PATH_PATTERNS[pattern]
    for inner in schema.get("properties", {}).values():
        _say_no_nul(inner)
    for key in ("items", "additionalProperties"):
        _say_no_nul(schema.get(key))
    for key in ("anyOf", "oneOf", "allOf"):
        for inner in schema.get(key, []):
            _say_no_nul(inner)


def strict_input(result: dict, generator, request, public) -> dict:
    """A drf-spectacular postprocessing hook: request bodies and parameters say what the API refuses besides their
    serializers' fields: NUL in any string, and a body's keys it does not know (`fields.RefuseUnknownKeys`)."""
    for name, component in result.get("components", {}).get("schemas", {}).items():
        if name.endswith("Request"):
            _say_no_nul(component)
            if "properties" in component:
                component.setdefault("additionalProperties", False)
    for operations in result.get("paths", {}).values():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                _say_no_nul(parameter.get("schema"))
    return result
