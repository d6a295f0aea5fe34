"""What weights the agent reports, and when it looks at the disk again.

Walking a weights root (hundreds of GB in thousands of files) on every
heartbeat would cost more than the heartbeat, so the disk is scanned:

* before the first hello (hello carries the full list);
* every `scan_every` heartbeats (default 12: once a minute at 5 s), to see
  what an operator copied in or deleted by hand;
* at the next heartbeat after a shard became ready or stopped (an engine may
  have downloaded weights) or after remove_weights.

Each source also carries what its weights' headers say of their size and
shape (agent/weights/facts.py), read in the scan's thread once per
modification stamp.

A scan runs in a thread and never holds a heartbeat back: a heartbeat starts
one when due and carries its result once it has finished, and only when the
list differs from the one last sent (most heartbeats carry `weights: null`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection

from agent.weights.facts import HeaderCache
from nodewire.protocol import RemoveWeights, WeightsStatus, encode
from nodewire.weights import disk
from nodewire.weights.messages import WeightsReport

log = logging.getLogger(__name__)

DEFAULT_SCAN_EVERY = 12


class WeightsInventory:
    """The weights under one root, as last scanned and as last sent to the control plane."""

    def __init__(self, root: str | None, scan_every: int = DEFAULT_SCAN_EVERY):
        if scan_every < 1:
            raise ValueError(f"weights scan interval must be at least 1 heartbeat, got {scan_every}")
        self.root = root
        self.scan_every = scan_every
        self.found: list[WeightsReport] | None = None
        self._sent: list[WeightsReport] | None = None
        self._beats = 0
        self._dirty = False
        self._scan: asyncio.Task | None = None
        self._removals: set[asyncio.Task] = set()
        self.headers = HeaderCache()
        # The sources a stage is fetching now (agent/weights/staging.py): not reported until they are all there.
        self.staging: Callable[[], set[str]] = set

    async def scan_now(self) -> list[WeightsReport] | None:
        """Scan and wait for the result (before hello); a failed scan leaves the weights unknown (None)."""
        if self.root is None:
            return None
        try:
            self.found = await asyncio.to_thread(self._read, self.staging())
        except OSError as exc:
            log.warning("could not scan the weights under %s: %s; they are reported once a scan works", self.root, exc)
        return self.found

    def for_hello(self) -> list[WeightsReport] | None:
        """The full list for a hello (None without a root); it counts as sent."""
        self._sent = self.found
        return self.found

    def changed(self) -> None:
        """Something may have changed on disk: scan at the next heartbeat."""
        self._dirty = True

    def for_heartbeat(self) -> list[WeightsReport] | None:
        """The list if a finished scan found it changed since last sent, else None; starts a scan when due."""
        if self.root is None:
            return None
        if self._scan is not None and self._scan.done():
            try:
                self.found = self._scan.result()
            except Exception as exc:  # a failed scan changes nothing; the next one may succeed
                log.warning("could not scan the weights under %s: %s", self.root, exc)
            self._scan = None
        self._beats += 1
        if self._scan is None and (self._dirty or self._beats % self.scan_every == 0):
            self._dirty = False
            self._scan = asyncio.ensure_future(asyncio.to_thread(self._read, self.staging()))
        if self.found is not None and self.found != self._sent:
            self._sent = self.found
            return self.found
        return None

    def _read(self, staging: Collection[str] = ()) -> list[WeightsReport]:
        """A scan, with each source's header facts (read once per modification stamp: agent/weights/facts.py),
        but the sources being staged."""
        assert self.root is not None
        found = [w for w in disk.scan(self.root) if w.source not in staging]
        self.headers.keep_only({w.path for w in found})
        return [
            WeightsReport(source=w.source, path=w.path, size_bytes=w.size_bytes, header=self.headers.facts(w.path))
            for w in found
        ]

    def start_removal(self, cmd: RemoveWeights, send: Callable[[bytes], Awaitable[bool]]) -> asyncio.Task:
        """Carry out remove_weights in the background and send its weights_status with `send`.

        Deleting hundreds of GB takes a while: the commands behind it must not wait.
        """

        async def run() -> None:
            status = await self.remove(cmd)
            if not await send(encode(status)):
                log.debug("not connected; dropped weights_status for %s", cmd.source)

        task = asyncio.create_task(run(), name=f"remove-weights-{cmd.source}")
        self._removals.add(task)  # a running task must be referenced, or it may be collected
        task.add_done_callback(self._removals.discard)
        return task

    async def remove(self, cmd: RemoveWeights) -> WeightsStatus:
        """Carry out remove_weights: delete inside the root only, or refuse and say why."""
        if self.root is None:
            return WeightsStatus(
                source=cmd.source, path=cmd.path, removed=False, message="this agent has no weights root"
            )
        try:
            message = await asyncio.to_thread(disk.remove, self.root, cmd.path)
        except disk.RefusedRemoval as exc:
            log.warning("remove_weights for %s refused: %s", cmd.source, exc)
            return WeightsStatus(source=cmd.source, path=cmd.path, removed=False, message=f"refused: {exc}")
        except OSError as exc:
            log.error("remove_weights for %s failed: %s", cmd.source, exc)
            return WeightsStatus(source=cmd.source, path=cmd.path, removed=False, message=f"failed: {exc}")
        log.info("weights of %s: %s", cmd.source, message)
        self.changed()
        return WeightsStatus(source=cmd.source, path=cmd.path, removed=True, message=message)
