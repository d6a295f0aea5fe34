"""Staging: a source's weights put on the node's disk before an engine needs them, holding no GPU.

`stage_weights` (nodewire/weights/staging_messages.py) asks for a source:

* a hub id (`org/name`) at a revision: what the revision holds (its commit,
  every file's size and published digest) comes from the first peer that
  knows (agent/weights/peer_server.py), else from the hub's own client
  (huggingface_hub, so `HF_ENDPOINT`, `HF_TOKEN` and the token file are
  honoured as an engine would). Each file is then copied from the peers the
  control plane named, or fetched from the hub when none can give it
  (agent/weights/origins.py), resumably and verified
  (agent/weights/transfer.py), into the Hugging Face cache layout under the
  weights root, the one engines read (`hub/models--org--name/{blobs,
  snapshots/<commit>, refs/<revision>}`), so an engine started afterwards
  finds every file and downloads nothing;
* an absolute path (a local or shared filesystem): checked, never copied.

A stage runs in a thread, one per source at a time (a repeat is answered by
the stage under way), and reports `staging_status` as it changes and about
once a second while bytes move. A file that fails (a cut connection, a
digest mismatch) is tried again, resuming, up to `attempts` failures; only
then does the stage fail, saying why. An engine is started by the control
plane only once the stage is `ready`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlencode

import httpx
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import build_hf_headers

from agent.weights.budget import make_room
from agent.weights.origins import FOLLOW_SECONDS, HUB, FileJob, Origin, fetch_from_origins
from agent.weights.transfer import READ_TIMEOUT_SECONDS, Digest, Progress, TransferError
from nodewire.protocol import encode
from nodewire.weights.disk import HUB_DIR, PARTIAL_SUFFIX, cache_dir_name
from nodewire.weights.staging_messages import Evictable, StagePeer, StageWeights, StagingStatus

log = logging.getLogger(__name__)

REPORT_SECONDS = 1.0
ATTEMPTS = 4
# How long a peer named by the control plane may have nothing to give before the stage passes it over: its
# own stage (it was named because it fetches the source) may begin a moment after this one.
PEER_PATIENCE_SECONDS = 30.0


@dataclass(frozen=True)
class HubFile:
    """One file of a revision: its name in the repository, size and published digest."""

    name: str
    size: int
    digest: Digest

    def __post_init__(self) -> None:
        # Names and digests come over the network (the hub, a peer) and become paths under the weights root.
        parts = self.name.split("/")
        if not self.name or self.name.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in self.name:
            raise TransferError(f"refusing the file name {self.name!r}: not a plain relative path")
        length = {"sha256": 64, "git-sha1": 40}.get(self.digest.kind)
        if length is None or not re.fullmatch(f"[0-9a-f]{{{length}}}", self.digest.hexdigest):
            raise TransferError(f"refusing {self.name}: {self.digest.kind} digest {self.digest.hexdigest!r} is not one")
        if self.size < 0:
            raise TransferError(f"refusing {self.name}: a negative size")

    @property
    def blob_name(self) -> str:
        # The cache names a blob by its ETag: the sha256 of an LFS file, the git blob id of the others.
        return self.digest.hexdigest


@dataclass(frozen=True)
class RevisionPlan:
    """What a revision of a hub repository holds, as the hub says."""

    repo_id: str
    revision: str
    commit: str
    files: tuple[HubFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def hub_plan(repo_id: str, revision: str, endpoint: str | None, token: str | None) -> RevisionPlan:
    """Ask the hub which commit `revision` is and what each file's size and digest are (blocking)."""
    info = HfApi(endpoint=endpoint, token=token).model_info(repo_id, revision=revision, files_metadata=True)
    files = []
    for sibling in info.siblings or []:
        if sibling.lfs is not None:
            files.append(HubFile(sibling.rfilename, sibling.lfs.size, Digest("sha256", sibling.lfs.sha256)))
        elif sibling.blob_id and sibling.size is not None:
            files.append(HubFile(sibling.rfilename, sibling.size, Digest("git-sha1", sibling.blob_id)))
        else:
            raise TransferError(f"the hub gave no size or digest for {repo_id}/{sibling.rfilename}")
    if not info.sha:
        raise TransferError(f"the hub named no commit for {repo_id} at {revision}")
    return RevisionPlan(repo_id, revision, info.sha, tuple(files))


def peer_plan(client: httpx.Client, origin: Origin, stage: Stage) -> RevisionPlan | None:
    """The plan a peer's weights server gives for the stage's revision, or None (it has none, or failed)."""
    url = f"{origin.base}/weights/plan?{urlencode({'source': stage.source, 'revision': stage.revision})}"
    try:
        response = client.get(url, headers=origin.headers)
        response.raise_for_status()
        body = response.json()
        files = tuple(HubFile(f["name"], int(f["size"]), Digest(f["kind"], f["digest"])) for f in body["files"])
        return RevisionPlan(stage.source, stage.revision, str(body["commit"]), files)
    except (httpx.HTTPError, TransferError, ValueError, KeyError, TypeError) as exc:
        log.info("no plan of %s from peer %s: %s", stage.source, origin.name, exc)
        return None


def cache_entry(root: str, repo_id: str) -> str:
    """The cache folder of `repo_id` under the weights root (the path nodes report it at)."""
    return os.path.join(root, HUB_DIR, cache_dir_name(repo_id))


def link_snapshot(entry: str, plan: RevisionPlan) -> None:
    """The snapshot folder and ref of a fetched revision, as the hub's client lays them out."""
    snapshot = os.path.join(entry, "snapshots", plan.commit)
    for f in plan.files:
        link = os.path.join(snapshot, f.name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        target = os.path.relpath(os.path.join(entry, "blobs", f.blob_name), os.path.dirname(link))
        if os.path.islink(link) and os.readlink(link) == target:
            continue
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(target, link)
    if plan.revision != plan.commit:
        refs = os.path.join(entry, "refs")
        os.makedirs(os.path.dirname(os.path.join(refs, plan.revision)), exist_ok=True)
        with open(os.path.join(refs, plan.revision), "w") as ref:
            ref.write(plan.commit)


class Stage:
    """One source being staged: where from, its plan once known, progress, state and the thread's cancel flag."""

    def __init__(
        self, source: str, revision: str, peers: Sequence[StagePeer] = (), evictable: Sequence[Evictable] = ()
    ):
        self.source = source
        self.revision = revision
        self.peers = tuple(peers)
        self.evictable = tuple(evictable)
        self.plan: RevisionPlan | None = None
        self.fetched: dict[str, int] = {}  # origin name -> bytes of the files it gave
        # Until then, a peer that has nothing yet is waited for (origins.FileJob.patience_until).
        self.patience_until = time.monotonic() + PEER_PATIENCE_SECONDS
        self.state = "fetching"
        self.message = ""
        self.path = ""
        self.progress = Progress(0)
        self.cancelled = threading.Event()

    def status(self, rate: float = 0.0) -> StagingStatus:
        done = max(0, min(self.progress.done, self.progress.total))
        return StagingStatus(
            source=self.source, revision=self.revision, state=self.state,  # type: ignore[arg-type]
            bytes_done=done, bytes_total=self.progress.total, bytes_per_second=max(rate, 0.0),
            message=self.message, path=self.path,
        )  # fmt: skip


class Staging:
    """The node's stages, one per source; each reports through `send`."""

    def __init__(
        self,
        root: str | None,
        send: Callable[[bytes], Awaitable[bool]],
        changed: Callable[[], None],
        *,
        hub_endpoint: str | None = None,
        hub_token: str | None = None,
        budget: int | None = None,
        report_seconds: float = REPORT_SECONDS,
        attempts: int = ATTEMPTS,
    ):
        self.root = root
        self._send = send
        self._changed = changed  # the weights inventory scans again once a stage is ready
        self.hub_endpoint = hub_endpoint
        self.hub_token = hub_token
        self.budget = budget  # bytes the weights root may hold (agent --weights-budget); None: the disk's size
        self.report_seconds = report_seconds
        self.attempts = attempts
        self.stages: dict[str, Stage] = {}
        self._tasks: set[asyncio.Task] = set()

    def fetching(self) -> set[str]:
        """The sources being fetched now (the weights inventory does not report them yet)."""
        return {source for source, stage in self.stages.items() if stage.state == "fetching"}

    def plan_of(self, source: str) -> RevisionPlan | None:
        """The plan of `source` while it is being fetched here (the weights server tells copiers from it)."""
        stage = self.stages.get(source)
        return stage.plan if stage is not None and stage.state == "fetching" else None

    def begin(self, cmd: StageWeights) -> None:
        """Start staging `cmd.source` unless it is already under way (a repeat changes nothing)."""
        known = self.stages.get(cmd.source)
        if known is not None and known.state == "fetching":
            return
        stage = Stage(cmd.source, cmd.revision, cmd.peers, cmd.evictable)
        self.stages[cmd.source] = stage
        task = asyncio.create_task(self._run(stage), name=f"stage-{cmd.source}")
        self._tasks.add(task)  # a running task must be referenced, or it may be collected
        task.add_done_callback(self._tasks.discard)

    async def cancel_all(self) -> None:
        """Stop every stage (agent shutdown): partial files stay, and the next stage resumes them."""
        for stage in self.stages.values():
            stage.cancelled.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, stage: Stage) -> None:
        reporter = asyncio.create_task(self._report_while_fetching(stage))
        started = time.monotonic()
        try:
            stage.path = await asyncio.to_thread(self._stage, stage)
            stage.state = "ready"
            self._changed()
        except Exception as exc:  # every failure is the stage's answer, never the agent's crash
            stage.state, stage.message = "failed", str(exc) or type(exc).__name__
        finally:
            reporter.cancel()
        took = time.monotonic() - started
        log.info("staging %s: %s in %.1f s %s", stage.source, stage.state, took, stage.message)
        if stage.state == "ready" and not stage.message:
            origins = ", ".join(f"{n} from {name}" for name, n in sorted(stage.fetched.items()) if n)
            stage.message = f"{stage.progress.total} bytes in {took:.1f} s" + (f" ({origins})" if origins else "")
        await self._send(encode(stage.status()))

    async def _report_while_fetching(self, stage: Stage) -> None:
        while True:
            await self._send(encode(stage.status(stage.progress.rate())))
            await asyncio.sleep(self.report_seconds)

    def _stage(self, stage: Stage) -> str:
        """Check or fetch one source (blocking); returns where its weights are."""
        if os.path.isabs(stage.source):
            if not os.path.exists(stage.source):
                raise TransferError(f"{stage.source} does not exist on this node")
            stage.message = "found on this node's filesystem; nothing copied"
            return stage.source
        if self.root is None:
            raise TransferError("this agent has no weights root to stage into")
        origins = self._origins(stage)
        with httpx.Client(follow_redirects=True, timeout=httpx.Timeout(30.0, read=READ_TIMEOUT_SECONDS)) as client:
            plan = stage.plan = self._plan(client, stage, origins)
            entry = cache_entry(self.root, plan.repo_id)
            os.makedirs(os.path.join(entry, "blobs"), exist_ok=True)
            self._fit(entry, plan, stage)
            for f in plan.files:
                blob = os.path.join(entry, "blobs", f.blob_name)
                job = FileJob(
                    plan.repo_id, plan.commit, f.name, f.size, f.digest, blob, stage.progress, stage.cancelled
                )
                had = os.path.exists(blob)
                origin = fetch_from_origins(client, origins, job, self.attempts)
                stage.fetched[origin] = stage.fetched.get(origin, 0) + (0 if had else f.size)
        link_snapshot(entry, plan)
        return entry

    def _origins(self, stage: Stage) -> list[Origin]:
        """The stage's peers, in the control plane's order, then the hub."""
        peers = [
            Origin(p.node, p.url.rstrip("/"), {"Authorization": f"Bearer {p.ticket}"}, peer=True) for p in stage.peers
        ]
        return [*peers, Origin(HUB, self.hub_endpoint, build_hf_headers(token=self.hub_token))]

    def _plan(self, client: httpx.Client, stage: Stage, origins: list[Origin]) -> RevisionPlan:
        """What the revision holds: from the first peer that knows, else from the hub (which is then asked once)."""
        peers = [o for o in origins if o.peer]
        plan = None
        while peers and plan is None:
            plan = next(filter(None, (peer_plan(client, o, stage) for o in peers)), None)
            if plan is None and (time.monotonic() >= stage.patience_until or stage.cancelled.is_set()):
                break
            if plan is None:
                time.sleep(FOLLOW_SECONDS)  # a peer named because it fetches the source may not have begun yet
        if plan is None:
            try:
                plan = hub_plan(stage.source, stage.revision, self.hub_endpoint, self.hub_token)
            except HfHubHTTPError as exc:
                raise TransferError(f"the hub refused {stage.source}@{stage.revision}: {exc}") from exc
        on_disk = sum(self._on_disk(plan, f) for f in plan.files)
        stage.progress = Progress(plan.total_bytes, done=on_disk)
        log.info("staging %s@%s (%s): %d files, %d bytes, %d on disk already", plan.repo_id, plan.revision,
                 plan.commit[:12], len(plan.files), plan.total_bytes, on_disk)  # fmt: skip
        return plan

    def _on_disk(self, plan: RevisionPlan, f: HubFile) -> int:
        """The bytes of `f` already on disk: all of a verified blob, or what a cut fetch left."""
        assert self.root is not None
        blob = os.path.join(cache_entry(self.root, plan.repo_id), "blobs", f.blob_name)
        for path, whole in ((blob, True), (blob + PARTIAL_SUFFIX, False)):
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                continue
            return f.size if whole else (size if size <= f.size else 0)  # a longer one is thrown away
        return 0

    def _fit(self, entry: str, plan: RevisionPlan, stage: Stage) -> None:
        """Room for what is missing: under the weights budget (removing what the control plane said may go, least
        recently used first) and on the disk; TransferError saying why not."""
        assert self.root is not None
        missing = plan.total_bytes - stage.progress.done
        if self.budget is not None and make_room(self.root, self.budget, missing, stage.evictable, stage.source):
            self._changed()
        free = shutil.disk_usage(entry).free
        if missing > free:
            raise TransferError(
                f"{plan.repo_id} needs {missing / 1e9:.1f} GB more on this node's disk, {free / 1e9:.1f} GB are free"
            )
