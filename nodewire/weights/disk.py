"""Model weights on a node's disk: where each source lives under the weights root, what is there, and removal.

The control plane imports the pure part (`weights_key`, `weights_path`) to
know which nodes hold a profile's weights; the agent uses all of it.

Layout under the weights root (the agent's `--weights-root`, given to engines
as HF_HOME so their downloads land there):

* vLLM, SGLang and the mock engine load hub repositories: source `ORG/NAME`
  lives in the Hugging Face cache at `<root>/hub/models--ORG--NAME` (blobs/,
  refs/, snapshots/ inside);
* llama.cpp loads one GGUF file: a relative source is a path under the root,
  an absolute one must lie inside the root.

An absolute source for the other engines (a local folder) is a path too,
matched against what nodes report; a scan does not look for such folders,
so they are not tracked unless they are GGUF files.

A scan reports every cache entry (but one only a first stage is filling: partial
blobs, no snapshot yet) and every `.gguf` file under the root, keyed
by source: the repository id, or the GGUF path relative to the root. Sizes
count regular files only (snapshots are symlinks to blobs, counted once).
"""

from __future__ import annotations

import os
import posixpath
import shutil
from dataclasses import dataclass

HUB_DIR = "hub"
CACHE_PREFIX = "models--"
GGUF_SUFFIX = ".gguf"
GGUF_ENGINES = ("llamacpp",)
# A blob being fetched by staging (agent/weights/transfer.py) until its bytes verify.
PARTIAL_SUFFIX = ".partial"


def weights_key(engine: str, source: str) -> str:
    """The key a node reports a source's weights under: the repository id, or the normalised GGUF path.

    An absolute GGUF path stays absolute: the control plane matches it against
    the path nodes report (it does not know their roots).
    """
    source = source.strip()
    if engine in GGUF_ENGINES or source.startswith("/"):
        return posixpath.normpath(source)
    return source.strip("/")


def cache_dir_name(repo_id: str) -> str:
    """The Hugging Face cache folder of a hub repository: `ORG/NAME` → `models--ORG--NAME`."""
    return CACHE_PREFIX + repo_id.replace("/", "--")


def repo_id_of(dir_name: str) -> str | None:
    """The repository id a cache folder holds, or None if the folder is not a model's."""
    if not dir_name.startswith(CACHE_PREFIX) or len(dir_name) == len(CACHE_PREFIX):
        return None
    return dir_name[len(CACHE_PREFIX) :].replace("--", "/")


def weights_path(root: str, engine: str, source: str) -> str:
    """Where a profile's weights live under `root` (ValueError for a GGUF path that leaves the root)."""
    key = weights_key(engine, source)
    if engine not in GGUF_ENGINES and not os.path.isabs(key):
        return os.path.join(root, HUB_DIR, cache_dir_name(key))
    path = os.path.normpath(key if os.path.isabs(key) else os.path.join(root, key))
    if not _strictly_inside(path, os.path.normpath(root)):
        raise ValueError(f"source {source!r} is not inside the weights root {root}")
    return path


@dataclass(frozen=True)
class WeightsOnDisk:
    """One source's weights found by a scan."""

    source: str
    path: str
    size_bytes: int


def _size(path: str) -> int:
    if not os.path.isdir(path):
        return os.lstat(path).st_size
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            stat = os.lstat(os.path.join(folder, name))
            if not os.path.islink(os.path.join(folder, name)):
                total += stat.st_size
    return total


def scan(root: str) -> list[WeightsOnDisk]:
    """Every source's weights under `root`, sorted by source (blocking: run it off the event loop)."""
    found: list[WeightsOnDisk] = []
    hub = os.path.join(root, HUB_DIR)
    if os.path.isdir(hub):
        for entry in sorted(os.listdir(hub)):
            repo_id = repo_id_of(entry)
            path = os.path.join(hub, entry)
            if repo_id is not None and os.path.isdir(path) and not os.path.islink(path) and not _first_stage(path):
                found.append(WeightsOnDisk(repo_id, path, _size(path)))
    for folder, dirs, files in os.walk(root):
        if folder == root and HUB_DIR in dirs:
            dirs.remove(HUB_DIR)  # the cache was listed above; its files are not GGUF sources
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(GGUF_SUFFIX) and not os.path.islink(path):
                found.append(WeightsOnDisk(os.path.relpath(path, root), path, os.lstat(path).st_size))
    return sorted(found, key=lambda w: w.source)


def _first_stage(entry: str) -> bool:
    """Whether a cache entry is only a stage under way (or cut): partial blobs and no snapshot an engine could
    load yet. It is not reported, so no engine is placed on it before its weights are all there."""
    if os.path.isdir(os.path.join(entry, "snapshots")):
        return False
    try:
        return any(name.endswith(PARTIAL_SUFFIX) for name in os.listdir(os.path.join(entry, "blobs")))
    except OSError:
        return False


def _strictly_inside(path: str, root: str) -> bool:
    return path != root and os.path.commonpath([path, root]) == root


class RefusedRemoval(ValueError):
    """A path the agent will not delete; the text says why."""


def removable_path(root: str, path: str) -> str:
    """The real path to delete for a remove_weights command, or RefusedRemoval.

    Only something strictly inside the weights root, after symlinks are
    resolved: no `..` component, no symlink on the way (one could lead out of
    the root, or to weights other than those named), never the root itself.
    """
    if not path:
        raise RefusedRemoval("the path is empty")
    if ".." in path.replace("\\", "/").split("/"):
        raise RefusedRemoval(f"{path} contains '..'")
    real_root = os.path.realpath(root)
    norm = os.path.normpath(path if os.path.isabs(path) else os.path.join(root, path))
    if norm in (os.path.normpath(root), real_root):
        raise RefusedRemoval(f"{path} is the weights root itself")
    # The root may itself be reached through a symlink (/data → /mnt/data): either spelling names it.
    base = next((b for b in (os.path.normpath(root), real_root) if _strictly_inside(norm, b)), None)
    if base is None:
        raise RefusedRemoval(f"{path} is not inside the weights root {root}")
    real = os.path.realpath(norm)
    if not _strictly_inside(real, real_root):
        raise RefusedRemoval(f"{path} resolves to {real}, outside the weights root {root}")
    if os.path.relpath(real, real_root) != os.path.relpath(norm, base):
        raise RefusedRemoval(f"{path} goes through a symlink (to {real}); only real folders and files are removed")
    return real


def remove(root: str, path: str) -> str:
    """Delete the weights at `path` under `root` (blocking); return what was done, or raise RefusedRemoval."""
    real = removable_path(root, path)
    if not os.path.lexists(real):
        return f"{path} was already absent"
    if os.path.isdir(real):
        shutil.rmtree(real)
    else:
        os.unlink(real)
    return f"removed {path}"
