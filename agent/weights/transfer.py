"""One weights file fetched over HTTP: resumable by range, checked against its digest before it is kept.

Staging (agent/weights/staging.py) fetches every file of a revision with
`fetch_file`, from the hub or from a peer node; one code path for both.

* The bytes go to `<blob>.partial` beside where the file will live. A fetch
  cut midway (a reset, a timeout, the agent killed) leaves the partial file;
  the next fetch of the same file asks for the rest with `Range: bytes=N-` and
  hashes the N bytes it already has first. A server that ignores the range
  (200 instead of 206) is read from the start again.
* The digest is the one the hub publishes for the file: the sha256 of an LFS
  file's content, or the git blob id (sha1 of `blob <size>\\0` + content) of
  the others. A file whose bytes do not hash to it is deleted, never renamed
  into place: an engine can only ever find verified bytes in the cache.
* `Progress.add` is told of every chunk, so an operator sees bytes move.

huggingface_hub's own downloader deletes its partial file when a download
fails (each attempt writes a uniquely named temporary file), so it cannot
resume after the agent restarts, and it checks sizes, not digests: hence this
module. The hub's client still says what to fetch (staging.py).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from nodewire.weights.disk import PARTIAL_SUFFIX

CHUNK_BYTES = 1 << 20
# A connection that sends nothing for this long is cut and resumed: a stalled CDN edge must not hang a stage.
READ_TIMEOUT_SECONDS = 60.0
# A peer answers a blob it is still fetching itself with 404 and this header (agent/weights/peer_server.py).
STAGING_HEADER = "X-Llmgw-Staging"


class TransferError(Exception):
    """A file could not be fetched or did not verify; the text says which and why."""


class DigestMismatch(TransferError):
    """The bytes fetched do not hash to the file's published digest (they were deleted)."""


class NotYet(TransferError):
    """A peer is still fetching this file itself: wait for it rather than ask the hub."""


class NotHere(TransferError):
    """The server does not have the file (404), and is not fetching it."""


@dataclass(frozen=True)
class Digest:
    """What a file's content must hash to: `sha256` of the content, or `git-sha1` of its git blob."""

    kind: str
    hexdigest: str

    def hasher(self, size: int):
        if self.kind == "sha256":
            return hashlib.sha256()
        if self.kind == "git-sha1":
            h = hashlib.sha1()  # noqa: S324 - git's object id, not a security digest
            h.update(b"blob %d\0" % size)
            return h
        raise ValueError(f"unknown digest kind {self.kind!r}")


class Progress:
    """Bytes on disk for a stage, and the rate they arrive at; written by fetching threads, read by the reporter."""

    def __init__(self, total: int, done: int = 0):
        self.total = total
        self.done = done
        self._lock = threading.Lock()
        self._moved = 0  # bytes fetched (not found on disk): what the rate is measured on
        self._since = time.monotonic()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            self._moved += n

    def rewind(self, n: int) -> None:
        """Bytes counted as done were thrown away (a digest mismatch, a server ignoring the range)."""
        with self._lock:
            self.done -= n

    def rate(self) -> float:
        """Bytes a second fetched since the last call (the reporter calls it once a report)."""
        with self._lock:
            now = time.monotonic()
            elapsed, moved = now - self._since, self._moved
            self._since, self._moved = now, 0
        return moved / elapsed if elapsed > 0 else 0.0


def fetch_file(
    client: httpx.Client,
    url: str,
    headers: Mapping[str, str],
    blob: str,
    size: int,
    digest: Digest,
    progress: Progress,
    cancelled: threading.Event,
) -> None:
    """Fetch `url` into `blob` (resuming `blob`.partial), verified against `digest`; TransferError if not.

    Blocking: run it in a thread. Returns at once when `blob` is already there. `progress` counts bytes on
    disk: what a partial file holds is counted before the call (staging.py), what arrives during it.
    """
    if os.path.exists(blob):
        return
    partial = blob + PARTIAL_SUFFIX
    hasher = digest.hasher(size)
    have = _hash_existing(partial, size, hasher, progress)
    if have < size:
        try:
            have = _download(client, url, headers, partial, have, hasher, progress, cancelled)
        except _RangeIgnored:
            # The server sends the whole file instead of the rest: start again from its first byte.
            os.unlink(partial)
            progress.rewind(have)
            hasher = digest.hasher(size)
            have = _download(client, url, headers, partial, 0, hasher, progress, cancelled)
    if have != size:
        raise TransferError(f"{url}: got {have} bytes, expected {size}")
    if hasher.hexdigest() != digest.hexdigest:
        os.unlink(partial)
        progress.rewind(size)
        raise DigestMismatch(
            f"{os.path.basename(blob)}: the bytes fetched from {url} hash to {hasher.hexdigest()}, "
            f"not the published {digest.kind} {digest.hexdigest}; deleted"
        )
    os.replace(partial, blob)


def _hash_existing(partial: str, size: int, hasher, progress: Progress) -> int:
    """Hash the bytes a cut fetch left (already counted in `progress`); a longer one is thrown away."""
    try:
        have = os.path.getsize(partial)
    except FileNotFoundError:
        return 0
    if have > size:
        os.unlink(partial)
        return 0
    with open(partial, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            hasher.update(chunk)
    return have


def _download(client, url, headers, partial, have, hasher, progress, cancelled) -> int:
    """Append the rest of the file from offset `have`; returns the size reached."""
    request_headers = dict(headers)
    if have:
        request_headers["Range"] = f"bytes={have}-"
    try:
        with client.stream("GET", url, headers=request_headers) as response:
            if response.status_code == 200 and have:
                raise _RangeIgnored
            if response.status_code == 404:
                if response.headers.get(STAGING_HEADER) == "fetching":
                    raise NotYet(f"{url}: the peer is still fetching it")
                raise NotHere(f"{url}: not there")
            if response.status_code not in (200, 206):
                raise TransferError(f"{url}: HTTP {response.status_code} {response.reason_phrase}")
            with open(partial, "ab") as f:
                for chunk in response.iter_bytes():  # as it arrives: a cut keeps every byte received
                    if cancelled.is_set():
                        raise TransferError(f"{url}: cancelled")
                    f.write(chunk)
                    hasher.update(chunk)
                    have += len(chunk)
                    progress.add(len(chunk))
    except httpx.HTTPError as exc:
        raise TransferError(f"{url}: {type(exc).__name__}: {exc or 'connection cut'}") from exc
    return have


class _RangeIgnored(Exception):
    """A resumed fetch was answered with the whole file (200, not 206)."""
