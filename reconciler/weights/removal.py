"""Deleting a model or a profile frees the disk its weights took on every node (remove_weights).

A profile's source (its model's, keyed by engine: nodewire/weights/disk.py) is noted
when the profile is about to be deleted (deleting a model deletes its
profiles). After the deleting transaction commits, for each noted source that
no remaining profile still uses, every node whose Weights rows hold it is sent
remove_weights, after a second, short transaction that decides it (Outbox:
commands leave only after commit). Like every command it is pending until the
agent acknowledges it (per node and source: reconciler.outbox.pending_key), so a
node offline now gets it when it reconnects. The agent then answers with
weights_status; inventory.services forgets the row on success and keeps it
(with a warning) on refusal. What this misses (weights no profile ever named,
a source edited away, a removal refused) reconciler.weights.sweep removes later.
"""

from __future__ import annotations

import logging
import posixpath

from django.db import connection, transaction
from django.db.models import CharField, Value
from django.db.models.signals import pre_delete

from catalog.models import Adapter, Profile
from inventory.models import Weights
from nodewire.weights.disk import GGUF_ENGINES, weights_key
from reconciler.choices import ReplicaState
from reconciler.models import Replica
from reconciler.outbox import Outbox

log = logging.getLogger(__name__)


def profile_deleting(sender, instance: Profile, **_kwargs) -> None:
    """Note the profile's weights key; one check per transaction, after it commits."""
    key = weights_key(instance.engine, instance.model.source)
    pending = _pending_callback()
    if pending is not None:
        pending.keys.add(key)
        return

    def remove_unused() -> None:
        remove_unused.ran = True  # type: ignore[attr-defined]
        remove_unused_weights(remove_unused.keys)  # type: ignore[attr-defined]

    remove_unused.keys = {key}  # type: ignore[attr-defined]
    remove_unused.ran = False  # type: ignore[attr-defined]
    transaction.on_commit(remove_unused)


def _pending_callback():
    """This transaction's removal check, still waiting for its commit, if there is one."""
    if not connection.in_atomic_block:
        return None
    for entry in connection.run_on_commit:
        callback = entry[1]
        if getattr(callback, "ran", True) is False and hasattr(callback, "keys"):
            return callback
    return None


# Marks the LoRA adapters' rows in keys_in_use's one query (no engine is called that).
_ADAPTER = "(adapter)"


def keys_in_use() -> set[str]:
    """The weights keys of every profile of every model, of every LoRA adapter, and of the source every engine
    still running was started from (`Replica.source`: an edited model's old weights stay open until its engine
    stops); two queries.

    The whole catalog (it is small): keys are normalised forms of the sources,
    so they cannot be matched in SQL. An adapter from the hub lands in the
    same cache (engines get the weights root as HF_HOME); its source is read
    both ways, as a hub id and as a GGUF path, so it is kept whichever it is.
    """
    adapters = Adapter.objects.annotate(engine=Value(_ADAPTER, output_field=CharField()))
    profiles = Profile.objects.values_list("engine", "model__source").order_by()
    keys: set[str] = set()
    for engine, source in profiles.union(adapters.values_list("engine", "source").order_by(), all=True):
        engines = ("", GGUF_ENGINES[0]) if engine == _ADAPTER else (engine,)
        keys.update(weights_key(reading, source) for reading in engines)
    running = Replica.objects.exclude(source="").exclude(state=ReplicaState.PENDING)
    keys.update(weights_key(engine, source) for engine, source in running.values_list("profile__engine", "source"))
    return keys


def in_use(source: str, path: str, keys: set[str]) -> bool:
    """Whether a node's weights (reported `source` and `path`) are in use by some key of `keys_in_use`: the key
    is their source or path, or, for a key that is a path, one of the two paths lies inside the other (a
    profile's folder inside a hub cache entry, `…/models--org--x/snapshots/<rev>`; a folder of GGUF files
    holding the reported file). Paths are compared by whole components: `/w/x2` is not inside `/w/x`."""
    if source in keys or path in keys:
        return True
    return any(_related(path, key) for key in keys if key.startswith("/"))


def _related(a: str, b: str) -> bool:
    a, b = posixpath.normpath(a), posixpath.normpath(b)
    if not a.startswith("/"):
        return False
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def weights_in_use(rows) -> tuple[set[int], set[int]]:
    """Of Weights `rows` (pk, source, path), the pks in use and those not (the catalog read once: two queries)."""
    keys = keys_in_use()
    used: set[int] = set()
    unused: set[int] = set()
    for pk, source, path in rows:
        (used if in_use(source, path, keys) else unused).add(pk)
    return used, unused


def remove_unused_weights(keys: set[str]) -> int:
    """Send remove_weights for every node's copy of `keys` no remaining profile, adapter or running engine uses
    (`in_use`, by paths too); return how many were sent.

    Five queries: the remaining profiles and adapters, the running engines, the holders, the epoch, the pending rows.
    """
    remaining = keys_in_use()
    gone = keys - remaining
    if not gone:
        return 0
    with transaction.atomic():
        outbox = Outbox()
        rows = Weights.objects.values_list("node__name", "source", "path").order_by("node__name", "source")
        for node_name, source, path in rows:
            if in_use(source, path, gone) and not in_use(source, path, remaining):
                outbox.remove_weights(node_name, source, path)
        sent = len(outbox.commands)
        outbox.send_on_commit()
    if sent:
        log.info("sent %d remove_weights command(s) for %s", sent, ", ".join(sorted(gone)))
    return sent


def connect() -> None:
    """Listen for profile deletions (called once, from the app's ready())."""
    pre_delete.connect(profile_deleting, sender=Profile, dispatch_uid="weights-removal-profile-deleting")
