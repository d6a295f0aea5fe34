"""Key changes reach every router within a second: the control plane publishes changed keys' hashes.

Any save or delete of an ApiKey (admin, command, REST, shell) publishes its
hash through the hub once the transaction commits, and each router drops it
from its cache (`ApiKeyCache.follow`), so the next request reads the row
again. A bulk `QuerySet.update()` sends no signal: change keys' state with
`set_keys_active()`, which publishes. Writes of `last_used_at` alone are not
changes a router cares about and publish nothing.

A router holds each key with the budgets that apply to it (its own, its
holder's within its team, its team's), so saving or deleting a Budget
publishes the hashes of the keys it applies to, and of those it applied to
before, if the save moved it.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.db.models import Q, QuerySet

from hub import get_hub
from keys.models import ApiKey, Budget

log = logging.getLogger(__name__)

# Fields routers do not cache: writing only these changes nothing a router answers.
UNCACHED_FIELDS = frozenset({"last_used_at"})
# Where budget_saving leaves the stored row's scope (key, team, user) for budget_saved, on the instance saved.
SCOPE_BEFORE = "_scope_before_save"


def publish_on_commit(digests: list[str], using: str | None = None) -> None:
    """Publish these key hashes once the current transaction (if any) commits."""
    if digests:
        transaction.on_commit(lambda: publish_now(digests), using=using)


def publish_now(digests: list[str]) -> None:
    """Publish now; a store that cannot take it is logged, not raised: the routers' cache TTL is the backstop."""
    try:
        get_hub().publish_key_changes(digests)
    except Exception as exc:  # the change itself is committed; failing the admin's request would mislead
        log.warning(
            "could not push %d API key change(s) to the routers (they apply within the cache TTL): %s",
            len(digests),
            exc,
        )


def set_keys_active(keys: QuerySet[ApiKey], active: bool) -> int:
    """Revoke (`active=False`) or restore keys in one UPDATE and tell every router; return how many changed."""
    with transaction.atomic(using=keys.db):
        changed = keys.exclude(active=active)
        digests = list(changed.values_list("key_hash", flat=True))
        count: int = ApiKey.objects.using(keys.db).filter(key_hash__in=digests).update(active=active)
        publish_on_commit(digests, using=keys.db)
    return count


def key_saved(sender: Any, instance: ApiKey, update_fields: frozenset[str] | None = None, **kwargs: Any) -> None:
    """post_save receiver: publish the key's hash, unless only uncached fields were written."""
    if update_fields is not None and set(update_fields) <= UNCACHED_FIELDS:
        return
    publish_on_commit([instance.key_hash], using=kwargs.get("using"))


def key_deleted(sender: Any, instance: ApiKey, **kwargs: Any) -> None:
    """post_delete receiver: publish the deleted key's hash."""
    publish_on_commit([instance.key_hash], using=kwargs.get("using"))


def budget_keys(key_id: int | None, team_id: int | None, user_id: int | None) -> Q:
    """The keys a budget of this scope applies to: the key; a member's keys in the team; every key of the team."""
    if key_id is not None:
        return Q(pk=key_id)
    if team_id is None:
        return Q(pk__in=[])  # no scope (refused by Budget.clean): no key
    if user_id is not None:
        return Q(team_id=team_id, user_id=user_id)
    return Q(team_id=team_id)


def _scope(budget: Budget) -> tuple[int | None, int | None, int | None]:
    return budget.key_id, budget.team_id, budget.user_id


def budget_saving(sender: Any, instance: Budget, **kwargs: Any) -> None:
    """pre_save receiver: remember the scope the stored row has, so the keys a budget leaves hear of it too."""
    if instance._state.adding or instance.pk is None:
        return
    stored = Budget.objects.using(kwargs.get("using")).filter(pk=instance.pk)
    setattr(instance, SCOPE_BEFORE, stored.values_list("key_id", "team_id", "user_id").first())


def budget_saved(sender: Any, instance: Budget, **kwargs: Any) -> None:
    """post_save receiver: publish the hashes of the keys the budget applies to, and applied to before the save."""
    keys = budget_keys(*_scope(instance))
    before = getattr(instance, SCOPE_BEFORE, None)
    if before is not None and before != _scope(instance):
        keys |= budget_keys(*before)
    _publish_keys(keys, kwargs.get("using"))


def budget_deleted(sender: Any, instance: Budget, **kwargs: Any) -> None:
    """post_delete receiver: publish the hashes of the keys the budget applied to."""
    _publish_keys(budget_keys(*_scope(instance)), kwargs.get("using"))


def _publish_keys(keys: Q, using: str | None) -> None:
    digests = list(ApiKey.objects.using(using).filter(keys).values_list("key_hash", flat=True))
    publish_on_commit(digests, using=using)
