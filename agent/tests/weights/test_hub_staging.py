"""Staging from a hub (the mock hub, through the hub's own client): every byte fetched once, a cut or killed fetch
resumed where it stopped, corrupt bytes caught and fetched again, and a second node copying from the first
while it still fetches, so the hub serves each byte once for the cluster."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import msgspec
import pytest
from huggingface_hub import hf_hub_download

from agent.weights.peer_server import PeerServer
from agent.weights.staging import Staging
from mockhub.repos import make_safetensors_repo
from mockhub.server import Faults, MockHub
from nodewire.weights.staging_messages import ServeWeights, StagePeer, StageWeights

MB = 10**6
SOURCE = "org/w"
TICKET = "k" * 32


@pytest.fixture
def repo(tmp_path) -> Path:
    return make_safetensors_repo(tmp_path / "repos", SOURCE, 6 * MB, files=3)


def repo_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def node(root: Path, hub: MockHub, sent: list[dict], attempts=4) -> Staging:
    async def send(raw: bytes) -> bool:
        sent.append(msgspec.json.decode(raw))
        return True

    return Staging(str(root), send, lambda: None, hub_endpoint=hub.url, report_seconds=0.05, attempts=attempts)


async def finished(staging: Staging, source=SOURCE) -> None:
    while staging.stages[source].state == "fetching":
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.01)


def staged(root: Path, folder: Path) -> bool:
    """Every file where the hub's own client finds it offline, with the hub's bytes."""
    for path in folder.iterdir():
        found = hf_hub_download(SOURCE, path.name, cache_dir=root / "hub", local_files_only=True)
        if Path(found).read_bytes() != path.read_bytes():
            return False
    return True


def run_stage(tmp_path, repo, faults: Faults, root="n1", attempts=4) -> tuple[list[dict], dict]:
    async def scenario():
        hub = MockHub(repo.parents[1], faults)
        await hub.start()
        sent: list[dict] = []
        staging = node(tmp_path / root, hub, sent, attempts)
        staging.begin(StageWeights(epoch=1, source=SOURCE))
        await finished(staging)
        await hub.stop()
        return sent, dict(hub.served)

    return asyncio.run(scenario())


def test_a_stage_fetches_each_byte_once_into_the_cache_engines_read(tmp_path, repo):
    sent, served = run_stage(tmp_path, repo, Faults())
    assert sent[-1]["state"] == "ready" and sent[-1]["bytes_done"] == sent[-1]["bytes_total"] == repo_bytes(repo)
    assert sum(served.values()) == repo_bytes(repo)
    assert staged(tmp_path / "n1", repo)


def test_cut_connections_are_resumed_and_no_byte_is_fetched_twice(tmp_path, repo):
    sent, served = run_stage(tmp_path, repo, Faults(fail_after_bytes=700_000, fail_times=6), attempts=10)
    assert sent[-1]["state"] == "ready"
    assert sum(served.values()) == repo_bytes(repo)  # each cut response resumed by range from where it stopped
    assert staged(tmp_path / "n1", repo)


def test_a_corrupt_byte_is_caught_and_the_file_fetched_again_and_never_kept_if_it_stays_corrupt(tmp_path, repo):
    shard = sorted(p.name for p in repo.glob("*.safetensors"))[1]
    sent, _ = run_stage(tmp_path, repo, Faults(corrupt={f"{SOURCE}:{shard}"}, corrupt_times=1))
    assert sent[-1]["state"] == "ready" and staged(tmp_path / "n1", repo)

    sent, _ = run_stage(tmp_path, repo, Faults(corrupt={f"{SOURCE}:{shard}"}), root="n2", attempts=2)
    assert sent[-1]["state"] == "failed" and "hash to" in sent[-1]["message"]
    entry = tmp_path / "n2" / "hub" / "models--org--w"
    assert not (entry / "snapshots").exists()  # nothing an engine could load
    digest = hashlib.sha256((repo / shard).read_bytes()).hexdigest()
    assert not (entry / "blobs" / digest).exists()  # never kept under its name, where an engine would find it


def test_a_stage_killed_midway_resumes_from_where_it_was(tmp_path, repo):
    async def scenario():
        hub = MockHub(repo.parents[1], Faults(bytes_per_second=3 * MB))
        await hub.start()
        first = node(tmp_path / "n1", hub, [])
        first.begin(StageWeights(epoch=1, source=SOURCE))
        await asyncio.sleep(1.0)
        await first.cancel_all()  # the agent stops; its partial files stay
        before = sum(hub.served.values())
        hub.faults.bytes_per_second = None
        sent: list[dict] = []
        second = node(tmp_path / "n1", hub, sent)
        second.begin(StageWeights(epoch=1, source=SOURCE))
        await finished(second)
        await hub.stop()
        return before, sent, sum(hub.served.values())

    before, sent, total = asyncio.run(scenario())
    assert 0 < before < repo_bytes(repo)
    assert sent[-1]["state"] == "ready" and staged(tmp_path / "n1", repo)
    first_report = next(s for s in sent if s["bytes_total"])
    assert first_report["bytes_done"] > 0  # it began with what the first had left on disk
    assert total <= repo_bytes(repo) + 2 * 256 * 1024  # at most a chunk or two in flight when it stopped


def test_a_second_node_copies_from_the_first_while_it_fetches_and_the_hub_serves_each_byte_once(tmp_path, repo):
    async def scenario():
        hub = MockHub(repo.parents[1], Faults(bytes_per_second=4 * MB))
        await hub.start()
        first_sent: list[dict] = []
        second_sent: list[dict] = []
        first = node(tmp_path / "n1", hub, first_sent)
        server = PeerServer(str(tmp_path / "n1"), first.plan_of, "127.0.0.1", 0)
        await server.start()
        server.allow(ServeWeights(epoch=1, source=SOURCE, node="n2", ticket=TICKET))
        second = node(tmp_path / "n2", hub, second_sent)
        first.begin(StageWeights(epoch=1, source=SOURCE))
        peer = StagePeer(node="n1", url=f"http://127.0.0.1:{server.port}", ticket=TICKET)
        second.begin(StageWeights(epoch=1, source=SOURCE, peers=[peer]))
        await finished(first)
        await finished(second)
        await server.stop()
        await hub.stop()
        return first_sent, second_sent, sum(hub.served.values())

    first_sent, second_sent, served = asyncio.run(scenario())
    assert first_sent[-1]["state"] == second_sent[-1]["state"] == "ready"
    assert served == repo_bytes(repo)
    assert "from n1" in second_sent[-1]["message"] and "the hub" not in second_sent[-1]["message"]
    assert staged(tmp_path / "n2", repo)
