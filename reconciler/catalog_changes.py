"""A catalog change reaches the routers at once, not at the next tick (no 404 window for a new model).

After a transaction that saved or deleted catalog rows commits, the endpoint
table is rebuilt and published (only if it changed, DESIGN invariant 7), and
whoever runs ticks is told there is work (a new model's min replicas). Any
process may publish: the table is a pure function of the rows, and the next
tick republishes if a slower publisher raced an older table in.
"""

from __future__ import annotations

import logging

from django.db import connection, transaction
from django.db.models.signals import post_delete, post_save

from catalog.models import Adapter, Alias, Model, Profile
from hub import get_hub
from reconciler.endpoints import build_endpoint_table
from reconciler.signals import work_pending

log = logging.getLogger(__name__)


def catalog_changed(**_signal_kwargs) -> None:
    """Publish once after the transaction commits, however many catalog rows it saved or deleted
    (an admin save touches several rows; `catalog apply` may touch hundreds)."""
    if connection.in_atomic_block and any(_queued(entry[1]) for entry in connection.run_on_commit):
        return  # already queued for this transaction

    def publish() -> None:
        publish.ran = True  # type: ignore[attr-defined]
        _publish()

    publish.ran = False  # type: ignore[attr-defined]
    transaction.on_commit(publish)


def _queued(callback) -> bool:
    """Whether `callback` is a catalog publish still waiting for its commit."""
    return getattr(callback, "ran", True) is False and getattr(callback, "__qualname__", "").startswith(
        "catalog_changed."
    )


def _publish() -> None:
    publish_endpoint_table()
    work_pending.send(sender=None)


def publish_endpoint_table() -> None:
    """Build and publish the endpoint table now, outside a tick (only if it changed, DESIGN invariant 7).

    For changes routers should not wait a tick for: a catalog change, a replica
    woken for waiting requests. A failure is logged: the next tick publishes anyway.
    """
    try:
        get_hub().publish_endpoints(build_endpoint_table())
    except Exception as exc:
        log.warning("could not publish the endpoint table: %s", exc)


def connect() -> None:
    """Listen for catalog saves and deletes (called once, from the app's ready())."""
    for sender in (Model, Alias, Profile, Adapter):
        post_save.connect(catalog_changed, sender=sender, dispatch_uid=f"catalog-changed-save-{sender.__name__}")
        post_delete.connect(catalog_changed, sender=sender, dispatch_uid=f"catalog-changed-delete-{sender.__name__}")
