"""A team's changes reach every router that caches its keys, and a member who leaves keeps none of its keys.

A router holds each key with its team's scope (router.key_cache): saving a
team publishes the hashes of all its keys, so each router reads them again
within a second. A member removed from a team has their keys of that team
revoked: the team's models were theirs to use through the team only.
"""

from __future__ import annotations

from typing import Any

from keys.changes import publish_on_commit, set_keys_active
from keys.models import ApiKey
from teams.models import Membership, Team


def team_saved(sender: Any, instance: Team, **kwargs: Any) -> None:
    """post_save receiver: publish the hashes of the team's keys (its scope is part of each)."""
    using = kwargs.get("using")
    digests = list(ApiKey.objects.using(using).filter(team=instance).values_list("key_hash", flat=True))
    publish_on_commit(digests, using=using)


def member_left(sender: Any, instance: Membership, **kwargs: Any) -> None:
    """post_delete receiver: revoke the keys the user held in the team (and tell every router)."""
    using = kwargs.get("using")
    set_keys_active(ApiKey.objects.using(using).filter(team_id=instance.team_id, user_id=instance.user_id), False)
