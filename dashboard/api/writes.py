"""The REST API's writes, each one transaction, on the same rules as admin and `catalog apply`.

Models are written through `catalog.as_code.apply_catalog` with the request
body as one entry of a catalog file, so a model made by the API, by a file or
(on the same field validation) by admin passes the same checks and gets the
same messages. Nodes are cordoned and drained, replicas stopped and API keys
revoked through the reconciler's and the models' own paths.
"""

from __future__ import annotations

import re
from typing import Any

from django.db import transaction
from rest_framework.exceptions import PermissionDenied, ValidationError

from catalog.as_code import CatalogFileError, apply_catalog, export_catalog
from catalog.models import Model, name_clash
from catalog.sizing import fit_warnings, fleet_memory
from dashboard.api.write_serializers import ModelReplaceSerializer, ModelWriteSerializer, body_problems
from inventory.models import Node
from keys.models import ApiKey
from reconciler.lifecycle.drain import drain_nodes
from reconciler.lifecycle.transitions import stop_replica
from reconciler.models import Replica
from teams.models import Team

# Messages from the catalog file reader start with where the entry is in the file; here there is one entry.
_FILE_LABEL = re.compile(r'^models\[0\](?: "[^"]*")?: ')


def bad_request(messages: list[str]) -> ValidationError:
    """A 400 whose `errors` name each problem's field, and `detail` says them in one line."""
    return ValidationError({"detail": "; ".join(messages), "errors": messages})


def _apply_one(entry: Any) -> Model:
    try:
        apply_catalog({"models": [entry]})
    except CatalogFileError as exc:
        raise bad_request([_FILE_LABEL.sub("", message) or message for message in exc.messages]) from None
    model = Model.objects.prefetch_related("aliases", "profiles", "adapters").get(name=entry["name"])
    # Warnings, not refusals (the estimate may be off): the answer carries them beside the model.
    # Carried to the serializer beside the model, not a column of it.
    model.warnings = fit_warnings(list(model.profiles.all()), fleet_memory())  # type: ignore[attr-defined]
    return model


def create_model(entry: Any) -> Model:
    """Create a model with its aliases, profiles and adapters (the catalog file's entry shape); 400 if anything is wrong."""
    if not isinstance(entry, dict):
        raise bad_request(["expected a JSON object with name, source, enabled, aliases, profiles and adapters"])
    if problems := body_problems(ModelWriteSerializer, entry):
        raise bad_request(problems)
    with transaction.atomic():
        name = entry.get("name")
        if isinstance(name, str) and (clash := name_clash(name)):
            raise bad_request([f"name: {clash}"])
        return _apply_one(entry)


def update_model(model: Model, changes: Any, *, partial: bool) -> Model:
    """Replace (`partial=False`) or change some of a model's fields, aliases, profiles and adapters; the name stays."""
    if not isinstance(changes, dict):
        raise bad_request(["expected a JSON object with source, enabled, aliases, profiles and adapters"])
    if problems := body_problems(ModelReplaceSerializer, changes, partial=partial):
        raise bad_request(problems)
    if "name" in changes and changes["name"] != model.name:
        raise bad_request([f"name: a model cannot be renamed (this is “{model.name}”); create a new one instead"])
    with transaction.atomic():
        if partial:
            # Export's own query picks this model's current entry; then the request's keys replace its keys.
            current = next(m for m in export_catalog()["models"] if m["name"] == model.name)
            entry = {**current, **changes}
        else:
            entry = {**changes, "name": model.name}
        return _apply_one(entry)


def set_cordoned(node: Node, cordoned: bool) -> Node:
    """Cordon (no new shards) or uncordon one node; its running replicas stay."""
    Node.objects.filter(pk=node.pk).update(schedulable=not cordoned)
    node.schedulable = not cordoned
    return node


def drain_node(node: Node) -> int:
    """Cordon the node; its serving replicas are replaced elsewhere, then drained (`reconciler.lifecycle.drain`).

    Returns how many replicas will be stopped.
    """
    _, replicas = drain_nodes([node.pk])
    node.schedulable = False
    return replicas


def stop_one_replica(replica: Replica, reason: str) -> None:
    """Stop one replica the way admin does (`reconciler.lifecycle.transitions.stop_replica`)."""
    stop_replica(replica, reason)


def issue_key(fields: dict[str, Any]) -> tuple[ApiKey, str]:
    """Create an API key on the model's own validation; return it with its secret (shown this once)."""
    candidate = ApiKey(**fields)
    try:
        candidate.full_clean(exclude=["prefix", "key_hash"])
    except Exception as exc:  # django ValidationError: re-raised as a 400 naming the fields
        raise ValidationError(getattr(exc, "message_dict", {"detail": str(exc)})) from None
    return ApiKey.issue(**fields)


def check_own_team(user: Any, team: Team | None) -> None:
    """A key someone who is not an operator makes belongs to a team of theirs: 400 without one, 403 for another."""
    if team is None:
        raise ValidationError({"team": ["A key of yours belongs to one of your teams: give its id."]})
    if not team.has_member(user.pk):
        raise PermissionDenied(f"You are not a member of the team “{team.name}”.")


def revoke_key(key: ApiKey) -> ApiKey:
    """Revoke a key. A save (not a bulk update) so the key's post_save signal tells every router at once."""
    if key.active:
        key.active = False
        key.save(update_fields=["active"])
    return key
