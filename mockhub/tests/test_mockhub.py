"""The mock hub speaks to the hub's own client as the hub does, and its faults do what they say."""

import asyncio
import hashlib
import threading
import time
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

from mockhub.repos import make_safetensors_repo
from mockhub.server import Faults, MockHub

MB = 10**6


class Running:
    """The hub on a loop of its own thread, so the (blocking) client can be called from the test."""

    def __init__(self, root, faults=None):
        self.hub = MockHub(root, faults)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> MockHub:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.hub.start(), self.loop).result(5)
        return self.hub

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.hub.stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def repo(tmp_path):
    folder = make_safetensors_repo(tmp_path / "repos", "org/tiny", 4 * MB, files=2)
    return tmp_path / "repos", folder


def test_the_hubs_own_client_reads_the_revision_and_downloads_into_its_cache_layout(repo, tmp_path):
    root, folder = repo
    with Running(root) as hub:
        info = HfApi(endpoint=hub.url).model_info("org/tiny", revision="main", files_metadata=True)
        shard = next(s for s in info.siblings if s.rfilename.endswith(".safetensors"))
        content = (folder / shard.rfilename).read_bytes()
        assert shard.lfs.sha256 == hashlib.sha256(content).hexdigest() and shard.size == len(content)
        config = next(s for s in info.siblings if s.rfilename == "config.json")
        assert config.lfs is None and config.blob_id
        path = hf_hub_download("org/tiny", shard.rfilename, cache_dir=tmp_path / "cache", endpoint=hub.url)
        assert Path(path).read_bytes() == content
        assert f"models--org--tiny/snapshots/{info.sha}/" in path
        with pytest.raises(RepositoryNotFoundError):
            HfApi(endpoint=hub.url).model_info("org/none")
        with pytest.raises(RevisionNotFoundError):
            HfApi(endpoint=hub.url).model_info("org/tiny", revision="v9")


def test_ranges_faults_and_tokens(repo):
    root, folder = repo
    name = sorted(p.name for p in folder.glob("*.safetensors"))[0]
    content = (folder / name).read_bytes()
    faults = Faults(token="secret")
    with Running(root, faults) as hub:
        url = f"{hub.url}/org/tiny/resolve/main/{name}"
        auth = {"Authorization": "Bearer secret"}
        assert httpx.get(url).status_code == 401
        part = httpx.get(url, headers={**auth, "Range": "bytes=100-199"})
        assert part.status_code == 206 and part.content == content[100:200]
        assert httpx.get(url, headers={**auth, "Range": f"bytes={len(content)}-"}).status_code == 416
        faults.fail_after_bytes, faults.fail_times = 1000, 1
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, headers=auth)  # cut after 1000 bytes
        assert httpx.get(url, headers=auth).content == content  # only the first response was cut
        faults.corrupt, faults.corrupt_times = {f"org/tiny:{name}"}, 1
        assert httpx.get(url, headers=auth).content != content
        assert httpx.get(url, headers=auth).content == content
        stats = httpx.get(f"{hub.url}/_stats").json()
        assert stats["served"][f"org/tiny/{name}"] == 100 + 1000 + 3 * len(content)


def test_the_throttle_is_the_whole_hubs_rate(repo):
    root, folder = repo
    names = sorted(p.name for p in folder.glob("*.safetensors"))
    with Running(root, Faults(bytes_per_second=4 * MB)) as hub:
        started = time.monotonic()

        def get(name):
            return httpx.get(f"{hub.url}/org/tiny/resolve/main/{name}", timeout=30).content

        threads = [threading.Thread(target=get, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.monotonic() - started
    total = sum((folder / n).stat().st_size for n in names)
    assert took >= 0.8 * total / (4 * MB)  # two downloads together, not each, at the hub's rate


def test_a_snapshot_download_lists_the_tree_and_fetches_every_file(repo, tmp_path):
    root, folder = repo
    with Running(root) as hub:
        snapshot = Path(snapshot_download("org/tiny", cache_dir=tmp_path / "cache", endpoint=hub.url))
        assert sorted(p.name for p in snapshot.iterdir()) == sorted(p.name for p in folder.iterdir())
        assert sum(hub.served.values()) == sum(p.stat().st_size for p in folder.iterdir())
