"""The REST API's writes, each one transaction, on the same rules as admin and `catalog apply`.

Models are written through `catalog.as_code.apply_catalog` with the request
body as one entry of a catalog file, so a model made by the API, by a file or
(on the same field validation) by admin passes the same checks and gets the
same messages. Nodes are cordoned and drained, replicas stopped and API keys
revoked through the reconciler's and the models' own paths. Budgets are
written on Budget.clean, within the teams the asker administers.
"""

from __future__ import annotations

import re
from typing import Any

from django.core.exceptions import ValidationError as ModelValidationError
from django.db import IntegrityError, transaction
from rest_framework.exceptions import PermissionDenied, ValidationError

from catalog.as_code import CatalogFileError, apply_catalog, export_catalog
from catalog.models import Model, name_clash
from catalog.sizing import fit_warnings, fleet_memory
from dashboard.api.write_serializers import ModelReplaceSerializer, ModelWriteSerializer, body_problems
from hub.priority import RANKS
from inventory.models import Node
from keys.models import ApiKey, Budget
from reconciler.lifecycle.drain import drain_nodes
from reconciler.lifecycle.transitions import stop_replica
from reconciler.models import Replica
from teams.access import administered_budgets, administered_teams, is_operator
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


def check_priority_class(asked: str, team: Team) -> None:
    """A member's key may ask for its team's priority class or a lower one, never a higher: 403 naming both."""
    if asked and RANKS[asked] < RANKS[team.priority_class]:
        raise PermissionDenied(
            f"A key of the team “{team.name}” may not ask for the {asked} class, above the team's "
            f"({team.priority_class}); an operator sets a team's class."
        )


def revoke_key(key: ApiKey) -> ApiKey:
    """Revoke a key. A save (not a bulk update) so the key's post_save signal tells every router at once."""
    if key.active:
        key.active = False
        key.save(update_fields=["active"])
    return key


def check_sets_budgets(user: Any) -> None:
    """Only operators and teams' admins set budgets: 403 for anyone else, before their body is read."""
    if not is_operator(user) and not administered_teams(user).exists():
        raise PermissionDenied(
            "Only operators and a team's admins set budgets; a member sees those that apply to them."
        )


def check_changes_budget(user: Any, budget: Budget) -> None:
    """A budget the asker sees but may not change (one that applies to them as a member): 403."""
    if not administered_budgets(user).filter(pk=budget.pk).exists():
        raise PermissionDenied(f"Only an operator or an admin of its team changes the budget of {budget.scope_text()}.")


def save_budget(user: Any, budget: Budget) -> Budget:
    """Create or change a budget on the model's own validation (Budget.clean), in a scope the asker administers.

    403 naming `team` or `key` for a scope of another team; 400 naming the field for bad input, and `window` for
    a scope that has a budget of that window already. Routers hear of it once it commits (keys.changes).
    """
    if not is_operator(user):
        _check_budget_scope(user, budget)
    try:
        # Constraints left to the check below (the one-scope rule is Budget.clean's too): theirs name no field.
        budget.full_clean(validate_constraints=False)
    except ModelValidationError as exc:
        raise ValidationError(exc.message_dict) from None
    twins = Budget.objects.filter(key=budget.key_id, team=budget.team_id, user=budget.user_id, window=budget.window)
    if twin := twins.exclude(pk=budget.pk).first():
        raise _window_taken(budget, f" (id {twin.pk}): change that one")
    try:
        with transaction.atomic():
            budget.save()
    except IntegrityError:  # made by another request between the check and the save
        raise _window_taken(budget, "") from None
    return budget


def _window_taken(budget: Budget, which: str) -> ValidationError:
    message = f"There is a budget of {budget.scope_text()} for the window “{budget.window}” already{which}."
    return ValidationError({"window": [message]})


def _check_budget_scope(user: Any, budget: Budget) -> None:
    """403 naming the field unless the budget's key or team is of a team the asker administers."""
    teams = administered_teams(user)
    key, team = budget.key, budget.team
    if key is not None:
        if key.team is None:
            raise PermissionDenied({"key": [f"The key “{key.name}” is in no team: only an operator sets its budget."]})
        if not teams.filter(pk=key.team.pk).exists():
            message = f"Only an admin of the team “{key.team.name}” sets the budgets of its keys."
            raise PermissionDenied({"key": [message]})
    elif team is not None and not teams.filter(pk=team.pk).exists():
        raise PermissionDenied({"team": [f"Only an admin of the team “{team.name}” sets its budgets."]})


def delete_budget(user: Any, budget: Budget) -> None:
    """Delete a budget the asker may change (403 otherwise); routers hear of it once it commits."""
    check_changes_budget(user, budget)
    budget.delete()
