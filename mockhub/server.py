"""The mock hub's HTTP server (aiohttp), serving repositories from folders: `ROOT/<org>/<name>/<files>`.

Endpoints, as the `huggingface_hub` client calls them:

* `GET /api/models/{org}/{name}[/revision/{rev}]` (`?blobs=true`): the commit (`sha`) and `siblings`
  `[{rfilename, size, blobId, lfs: {sha256, size, pointerSize}}]`; weights files (`.safetensors`, `.gguf`,
  `.bin`, and anything over 10 MB) are LFS files, published by their sha256, the rest by their git blob id.
* `GET /api/models/{org}/{name}/tree/{rev}`: the same files as a tree listing (the client's snapshot download).
* `HEAD`/`GET /{org}/{name}/resolve/{rev}/{path}`: the file, with `X-Repo-Commit`, `ETag` (and for LFS files
  `X-Linked-Etag`, `X-Linked-Size`) and single HTTP ranges (206, or 416 past the end).
* `GET /_stats`, `POST /_reset`: body bytes served per `org/name/path`, and requests; `POST /_faults`: change
  the faults below while running.

A repository's commit is derived from its files' names and digests, so a test can predict it; revision `main`
and the commit itself resolve to it, anything else is `RevisionNotFound`, an unknown repository
`RepoNotFound` (the `X-Error-Code` the client reads). Digests are computed once per file (path, size, mtime).

Faults: `bytes_per_second` (one token bucket shared by every connection), `fail_after_bytes` (a response is cut
after that many body bytes; `fail_times` how many are, unlimited while unset), `corrupt` (`org/name:path`
entries whose served bytes have one byte flipped, the middle one; `corrupt_times` how many responses), `token`
(every request but the `/_` ones needs `Authorization: Bearer <token>`).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

CHUNK = 256 * 1024
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")
LFS_MIN_BYTES = 10 * 10**6


@dataclass
class Faults:
    """What the hub does wrong now; every field may be changed while it runs (POST /_faults)."""

    bytes_per_second: float | None = None
    fail_after_bytes: int | None = None
    fail_times: int | None = None
    corrupt: set[str] = field(default_factory=set)
    corrupt_times: int | None = None
    token: str | None = None


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int
    sha256: str
    git_sha1: str
    lfs: bool

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_sha1


class _Bucket:
    """A token bucket shared by all connections: the hub's whole rate, not each download's."""

    def __init__(self) -> None:
        self.level = 0.0
        self.at = time.monotonic()

    async def take(self, n: int, rate: float | None) -> None:
        if rate is None:
            return
        now = time.monotonic()
        self.level = min(rate * 0.25, self.level + (now - self.at) * rate)  # at most a quarter second of burst
        self.at = now
        self.level -= n
        if self.level < 0:
            await asyncio.sleep(-self.level / rate)


class MockHub:
    """Serves the repositories under `root`; `await start()` returns its URL."""

    def __init__(self, root: str | os.PathLike, faults: Faults | None = None, host: str = "127.0.0.1", port: int = 0):
        self.root = Path(root)
        self.faults = faults or Faults()
        self.host, self.port = host, port
        self.served: Counter[str] = Counter()  # body bytes per org/name/path
        self.requests: Counter[str] = Counter()
        self._digests: dict[tuple[str, int, int], tuple[str, str]] = {}
        self._bucket = _Bucket()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/_stats", self._stats)
        app.router.add_post("/_reset", self._reset)
        app.router.add_post("/_faults", self._set_faults)
        app.router.add_get("/api/models/{org}/{name}", self._info)
        app.router.add_get("/api/models/{org}/{name}/revision/{revision}", self._info)
        app.router.add_get("/api/models/{org}/{name}/tree/{revision}", self._tree)
        app.router.add_route("*", "/{org}/{name}/resolve/{revision}/{path:.+}", self._resolve)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def files(self, repo: str) -> list[HubFile]:
        folder = self.root / repo
        if not folder.is_dir():
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound"}, text=f"repository {repo} not found")
        found = []
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            stat = path.stat()
            key = (str(path), stat.st_size, stat.st_mtime_ns)
            if key not in self._digests:
                self._digests[key] = _digests(path, stat.st_size)
            sha256, git_sha1 = self._digests[key]
            lfs = path.name.endswith(LFS_SUFFIXES) or stat.st_size > LFS_MIN_BYTES
            found.append(HubFile(path.relative_to(folder).as_posix(), stat.st_size, sha256, git_sha1, lfs))
        return found

    def commit(self, repo: str, files: list[HubFile]) -> str:
        text = repo + "".join(f"\n{f.path} {f.sha256}" for f in files)
        return hashlib.sha1(text.encode()).hexdigest()  # noqa: S324 - a name, as git's are

    def _resolve_revision(self, repo: str, revision: str) -> tuple[list[HubFile], str]:
        files = self.files(repo)
        commit = self.commit(repo, files)
        if revision not in ("main", commit):
            raise web.HTTPNotFound(headers={"X-Error-Code": "RevisionNotFound"}, text=f"revision {revision} not found")
        return files, commit

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        token = self.faults.token
        authorized = request.headers.get("Authorization", "") == f"Bearer {token}"
        if token and not request.path.startswith("/_") and not authorized:
            raise web.HTTPUnauthorized(text="invalid credentials")
        return await handler(request)

    async def _info(self, request: web.Request) -> web.Response:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        files, commit = self._resolve_revision(repo, request.match_info.get("revision", "main"))
        siblings = []
        for f in files:
            sibling: dict = {"rfilename": f.path, "size": f.size, "blobId": f.git_sha1}
            if f.lfs:
                sibling["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
            siblings.append(sibling)
        return web.json_response({"id": repo, "modelId": repo, "sha": commit, "private": False, "siblings": siblings})

    async def _tree(self, request: web.Request) -> web.Response:
        """The files of a revision, as its client's snapshot download lists them (one page: no `Link` header)."""
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        files, _commit = self._resolve_revision(repo, request.match_info["revision"])
        entries = []
        for f in files:
            entry: dict = {"type": "file", "path": f.path, "size": f.size, "oid": f.git_sha1}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
            entries.append(entry)
        return web.json_response(entries)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        files, commit = self._resolve_revision(repo, request.match_info["revision"])
        path = request.match_info["path"]
        found = next((f for f in files if f.path == path), None)
        if found is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound"}, text=f"{path} not in {repo}")
        headers = {"X-Repo-Commit": commit, "ETag": f'"{found.etag}"', "Accept-Ranges": "bytes"}
        if found.lfs:
            headers |= {"X-Linked-Etag": f'"{found.sha256}"', "X-Linked-Size": str(found.size)}
        start, end = _range(request.headers.get("Range"), found.size)
        length = end - start
        status = 200 if (start, end) == (0, found.size) else 206
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{found.size}"
        headers["Content-Length"] = str(length)
        self.requests[f"{repo}/{path}"] += 1
        response = web.StreamResponse(status=status, headers=headers)
        await response.prepare(request)
        if request.method == "GET":
            await self._send(response, request, self.root / repo / path, f"{repo}:{path}", f"{repo}/{path}", start, end)
        return response

    async def _send(self, response, request, file: Path, corrupt_key: str, stats_key: str, start: int, end: int):
        faults = self.faults
        cut_after = None
        if faults.fail_after_bytes is not None and (faults.fail_times is None or faults.fail_times > 0):
            cut_after = faults.fail_after_bytes
            if faults.fail_times is not None:
                faults.fail_times -= 1
        flip = None
        if corrupt_key in faults.corrupt and (faults.corrupt_times is None or faults.corrupt_times > 0):
            flip = file.stat().st_size // 2
            if faults.corrupt_times is not None and start <= flip < end:
                faults.corrupt_times -= 1
        sent = 0
        with open(file, "rb") as f:
            f.seek(start)
            position = start
            while position < end:
                chunk = bytearray(f.read(min(CHUNK, end - position)))
                if flip is not None and position <= flip < position + len(chunk):
                    chunk[flip - position] ^= 0xFF
                if cut_after is not None and sent + len(chunk) > cut_after:
                    chunk = chunk[: cut_after - sent]
                await self._bucket.take(len(chunk), faults.bytes_per_second)
                try:
                    await response.write(bytes(chunk))
                except ConnectionResetError:  # the client went away (killed, or it cut the download itself)
                    return
                sent += len(chunk)
                position += len(chunk)
                self.served[stats_key] += len(chunk)
                if cut_after is not None and sent >= cut_after:
                    assert request.transport is not None
                    request.transport.close()  # the client sees the body end early
                    return

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"served": dict(self.served), "requests": dict(self.requests), "total": sum(self.served.values())}
        )

    async def _reset(self, request: web.Request) -> web.Response:
        self.served.clear()
        self.requests.clear()
        return web.json_response({"ok": True})

    async def _set_faults(self, request: web.Request) -> web.Response:
        body = await request.json()
        unknown = set(body) - set(vars(self.faults))
        if unknown:
            raise web.HTTPBadRequest(text=f"unknown faults: {', '.join(sorted(unknown))}")
        for name, value in body.items():
            setattr(self.faults, name, set(value) if name == "corrupt" else value)
        return web.json_response({"ok": True})


def _digests(path: Path, size: int) -> tuple[str, str]:
    sha256 = hashlib.sha256()
    git = hashlib.sha1(b"blob %d\0" % size)  # noqa: S324 - git's object id
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha256.update(chunk)
            git.update(chunk)
    return sha256.hexdigest(), git.hexdigest()


def _range(header: str | None, size: int) -> tuple[int, int]:
    """[start, end) of a single `bytes=` range (the whole file without one); 416 when it starts past the end."""
    if not header or not header.startswith("bytes="):
        return 0, size
    first, _, last = header[len("bytes=") :].partition("-")
    start = int(first) if first else max(0, size - int(last))
    end = min(size, int(last) + 1) if first and last else size
    if start >= size and size > 0:
        raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
    return start, end
