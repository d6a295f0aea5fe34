"""Hugging Face cache entries made by hand for the staging tests: blobs named by digest, a snapshot, a ref."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from agent.weights.staging import HubFile, RevisionPlan, cache_entry, link_snapshot
from agent.weights.transfer import Digest


def digest_of(name: str, content: bytes) -> Digest:
    """What the hub publishes: sha256 for weights (LFS), the git blob id for the small files."""
    if name.endswith(".safetensors"):
        return Digest("sha256", hashlib.sha256(content).hexdigest())
    return Digest("git-sha1", hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest())  # noqa: S324


def plan_of(repo_id: str, files: dict[str, bytes], commit: str = "c0ffee" * 6 + "abcd") -> RevisionPlan:
    entries = tuple(HubFile(name, len(data), digest_of(name, data)) for name, data in sorted(files.items()))
    return RevisionPlan(repo_id, "main", commit, entries)


def hold(root: Path, repo_id: str, files: dict[str, bytes]) -> RevisionPlan:
    """Put `files` in the cache under `root` as the hub's client would, and return their plan."""
    plan = plan_of(repo_id, files)
    entry = cache_entry(str(root), repo_id)
    os.makedirs(os.path.join(entry, "blobs"), exist_ok=True)
    for f in plan.files:
        Path(entry, "blobs", f.blob_name).write_bytes(files[f.name])
    link_snapshot(entry, plan)
    return plan
