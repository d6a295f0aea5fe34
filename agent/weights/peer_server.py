"""The agent's weights server: other nodes copy this node's weights from it instead of asking the hub again.

The control plane names the copies (reconciler.weights.staging): it tells this
agent, over its authenticated link, which node may copy which source with
which ticket (`serve_weights`), and tells the copying agent where to go with
that ticket (stage_weights' `peers`). A request without a ticket this agent
was given, for that source and not expired, is refused (401): the same trust
as the agent link, with no new secret to distribute.

* `GET /weights/plan?source=ORG/NAME&revision=REV`: what the revision holds
  here (its commit, each file's name, size and digest), from the stage under
  way or from the cache entry's snapshot. A copier asks this, not the hub.
* `GET /weights/blob?source=ORG/NAME&digest=HEX`: one verified blob, with
  HTTP ranges (a cut copy resumes). Only verified blobs exist under their
  digest's name (agent/weights/transfer.py), so nothing half-fetched is served.
  A blob not here yet while this node is staging the source is answered 404
  with `X-Llmgw-Staging: fetching`: the copier waits for it rather than going
  to the hub, so the hub is asked once per cluster even when two nodes want
  the same weights at the same time.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable

from aiohttp import web

from agent.weights.staging import HubFile, RevisionPlan, cache_entry
from agent.weights.transfer import STAGING_HEADER, Digest
from nodewire.weights.staging_messages import ServeWeights

log = logging.getLogger(__name__)

_DIGEST = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$")


def plan_on_disk(root: str, source: str, revision: str) -> RevisionPlan | None:
    """What a cache entry holds of `revision`, read from its snapshot's links (None when it holds none)."""
    entry = cache_entry(root, source)
    try:
        with open(os.path.join(entry, "refs", revision)) as ref:
            commit = ref.read().strip()
    except OSError:
        commit = revision  # a pinned commit has no ref
    snapshot = os.path.join(entry, "snapshots", commit)
    if not os.path.isdir(snapshot):
        return None
    files = []
    for folder, _dirs, names in os.walk(snapshot):
        for name in names:
            link = os.path.join(folder, name)
            blob = os.path.basename(os.path.realpath(link))
            if not _DIGEST.match(blob) or not os.path.isfile(link):
                return None  # not the hub's cache layout: nothing to vouch for
            kind = "sha256" if len(blob) == 64 else "git-sha1"
            files.append(HubFile(os.path.relpath(link, snapshot), os.path.getsize(link), Digest(kind, blob)))
    return RevisionPlan(source, revision, commit, tuple(sorted(files, key=lambda f: f.name)))


class PeerServer:
    """Serves this node's verified weights to the copies the control plane allowed."""

    def __init__(self, root: str, staging_plan: Callable[[str], RevisionPlan | None], host: str, port: int):
        self.root = root
        self._staging_plan = staging_plan  # the plan of a source being staged here now, if any
        self.host, self.port = host, port
        self._tickets: dict[str, tuple[str, str, float]] = {}  # ticket -> (source, node, expires at)
        self._runner: web.AppRunner | None = None

    def allow(self, cmd: ServeWeights) -> None:
        """Accept `cmd.ticket` for `cmd.source` until `cmd.seconds` from now."""
        now = time.monotonic()
        self._tickets = {t: grant for t, grant in self._tickets.items() if grant[2] > now}
        self._tickets[cmd.ticket] = (cmd.source, cmd.node, now + cmd.seconds)

    async def start(self) -> int:
        """Listen; returns the port (the one asked for, or the one the system chose for 0)."""
        app = web.Application()
        app.router.add_get("/weights/plan", self._plan)
        app.router.add_get("/weights/blob", self._blob)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info("weights server listening on %s:%d", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _source(self, request: web.Request) -> str:
        """The source asked for, if the request's ticket allows it (else 401 or 400)."""
        source = request.query.get("source", "")
        if not source or source.startswith("/") or ".." in source.split("/"):
            raise web.HTTPBadRequest(text="source must be a hub repository id")
        ticket = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        grant = self._tickets.get(ticket)
        if grant is None or grant[0] != source or grant[2] <= time.monotonic():
            raise web.HTTPUnauthorized(text=f"no ticket for {source} from this node's control plane")
        return source

    async def _plan(self, request: web.Request) -> web.Response:
        source = self._source(request)
        revision = request.query.get("revision", "main")
        plan = self._staging_plan(source) or plan_on_disk(self.root, source, revision)
        if plan is None:
            raise web.HTTPNotFound(text=f"{source}@{revision} is not on this node")
        files = [
            {"name": f.name, "size": f.size, "kind": f.digest.kind, "digest": f.digest.hexdigest} for f in plan.files
        ]
        return web.json_response({"source": source, "revision": revision, "commit": plan.commit, "files": files})

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        source = self._source(request)
        digest = request.query.get("digest", "")
        if not _DIGEST.match(digest):
            raise web.HTTPBadRequest(text="digest must be 40 or 64 lowercase hex digits")
        blob = os.path.join(cache_entry(self.root, source), "blobs", digest)
        if not os.path.isfile(blob):
            fetching = {STAGING_HEADER: "fetching"} if self._staging_plan(source) is not None else {}
            raise web.HTTPNotFound(text=f"{digest} of {source} is not on this node (yet)", headers=fetching)
        return web.FileResponse(blob, chunk_size=1 << 20)
