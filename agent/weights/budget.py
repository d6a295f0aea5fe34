"""A node's weights budget: staging that would take the weights root past it first removes weights the control
plane said may go, least recently used first, and never anything else.

The control plane decides what is evictable (reconciler.weights.budget: no engine on the node runs them, no
profile pins them with `prefetch_nodes`, ordered by when an engine last started on them there); the agent,
which knows the sizes on its disk, removes as few of them as the new weights need. When even all of them would
not make room, nothing is removed and the stage fails, saying how much is missing and why: the replica backs off
and is tried again, by which time engines may have stopped.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from agent.weights.transfer import TransferError
from nodewire.weights import disk
from nodewire.weights.staging_messages import Evictable

log = logging.getLogger(__name__)

_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?)?B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from `500G`, `1.5T`, `800GiB` or a plain count (G = 10^9, GiB = 2^30); ValueError says why not."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size (e.g. 500G, 1.5T, 800GiB)")
    size = int(float(match[1]) * _UNITS[(match[2] or "").upper()])
    if size <= 0:
        raise ValueError(f"{text!r} is not a positive size")
    return size


def make_room(root: str, budget: int, needed: int, evictable: Sequence[Evictable], keep: str) -> list[str]:
    """Remove evictable weights (in the given order) until `needed` more bytes fit under `budget`; returns the
    sources removed. TransferError, removing nothing, when they could not make enough room. Blocking."""
    on_disk = {w.path: w for w in disk.scan(root)}
    used = sum(w.size_bytes for w in on_disk.values())
    over = used + needed - budget
    if over <= 0:
        return []
    chosen, freed = [], 0
    for item in evictable:
        found = on_disk.get(item.path)
        if found is None or found.source == keep or freed >= over:
            continue
        chosen.append(found)
        freed += found.size_bytes
    if freed < over:
        raise TransferError(
            f"{keep} needs {needed / 1e9:.1f} GB more under this node's weights budget of {budget / 1e9:.1f} GB "
            f"({used / 1e9:.1f} GB used); the unused, unpinned weights here free only {freed / 1e9:.1f} GB, the "
            "rest is in use or pinned: waiting for engines to stop"
        )
    for found in chosen:
        log.info("weights budget: removing %s (%d bytes, least recently used) to make room for %s",
                 found.source, found.size_bytes, keep)  # fmt: skip
        disk.remove(root, found.path)
    return [found.source for found in chosen]
