"""Where a stage's files come from: the peers the control plane named first, the hub last.

The hub is asked once per cluster: a file is fetched from the hub only when no
peer can give it. A peer that has the file serves it; a peer still fetching it
itself answers "not yet" (agent/weights/peer_server.py), and the copier waits
for it rather than asking the hub; a peer that fails (refused, unreachable, cut,
or bytes that do not verify) is passed over for that file. The hub is asked
again after a cut (resuming where it stopped) or bytes that did not verify
(from the first byte), up to the stage's attempts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlencode

import httpx
from huggingface_hub import hf_hub_url

from agent.weights.transfer import Digest, NotHere, NotYet, Progress, TransferError, fetch_file

log = logging.getLogger(__name__)

HUB = "the hub"
RETRY_BACKOFF_SECONDS = 1.0
# How often a copier asks a peer again for a file the peer is still fetching.
FOLLOW_SECONDS = 0.5


@dataclass(frozen=True)
class Origin:
    """One place to fetch files from: the hub (`peer` False), or a peer node's weights server."""

    name: str
    base: str | None  # a peer's URL; the hub's endpoint (None: the hub client's own, HF_ENDPOINT)
    headers: Mapping[str, str] = field(default_factory=dict)
    peer: bool = False

    def blob_url(self, repo_id: str, commit: str, name: str, digest: str) -> str:
        if self.peer:
            return f"{self.base}/weights/blob?{urlencode({'source': repo_id, 'digest': digest})}"
        return hf_hub_url(repo_id, name, revision=commit, endpoint=self.base)


@dataclass
class FileJob:
    """One file of a stage: where it goes, what it must hash to, and the stage's shared progress and flag."""

    repo_id: str
    commit: str
    name: str
    size: int
    digest: Digest
    blob: str
    progress: Progress
    cancelled: threading.Event
    # Until then (monotonic), a peer without the file is waited for: it was named because it holds or fetches
    # the source, so "not here" early means its own stage has not begun yet.
    patience_until: float = 0.0


def fetch_from_origins(client: httpx.Client, origins: list[Origin], job: FileJob, attempts: int) -> str:
    """Fetch one file from the first origin that can give it; returns that origin's name (TransferError if none
    could within `attempts` failures). Blocking: run it in a thread."""
    failures, passed_over = 0, set()
    while True:
        if job.cancelled.is_set():
            raise TransferError(f"{job.name}: cancelled")
        waiting = False
        for origin in origins:
            if origin.name in passed_over or (waiting and not origin.peer):
                continue  # a peer is fetching it: the hub is not asked
            url = origin.blob_url(job.repo_id, job.commit, job.name, job.digest.hexdigest)
            try:
                fetch_file(client, url, origin.headers, job.blob, job.size, job.digest, job.progress, job.cancelled)
                return origin.name
            except NotYet:
                waiting = True
                continue
            except NotHere:
                if origin.peer and time.monotonic() < job.patience_until:
                    waiting = True
                    continue
                passed_over.add(origin.name)
                continue
            except TransferError as exc:
                if job.cancelled.is_set():
                    raise
                if origin.peer:
                    # The next origin at once; a failed peer is not asked again for this file (peers are few, so
                    # their failures do not count against the hub's attempts).
                    log.warning("%s from peer %s failed: %s", job.name, origin.name, exc)
                    passed_over.add(origin.name)
                    continue
                failures += 1
                if failures >= attempts:
                    raise
                log.warning("%s from %s failed (%d of %d): %s", job.name, origin.name, failures, attempts, exc)
                time.sleep(RETRY_BACKOFF_SECONDS)  # the hub again, resuming (from the first byte after a mismatch)
                break
        else:
            if not waiting:
                raise TransferError(f"{job.name}: no origin left to fetch it from")
            time.sleep(FOLLOW_SECONDS)
