"""Copies between nodes: a stage takes its files from the peers the control plane named, follows a peer still
fetching them, passes over a peer that refuses or serves bytes that do not verify, and never asks the hub for
what a peer gave."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import msgspec
import pytest
from huggingface_hub import hf_hub_download

from agent.tests.weights.cache import hold, plan_of
from agent.weights.peer_server import PeerServer, plan_on_disk
from agent.weights.staging import HubFile, Staging
from agent.weights.transfer import Digest, TransferError
from nodewire.weights.staging_messages import ServeWeights, StagePeer, StageWeights

TICKET = "t" * 32
# Nothing listens there: a stage that asks the hub fails at once, so a test sees it did.
NO_HUB = "http://127.0.0.1:9"


def weights(sizes=(3 << 20, 2 << 20)) -> dict[str, bytes]:
    files = {f"model-{i + 1:05d}.safetensors": os.urandom(size) for i, size in enumerate(sizes)}
    return {"config.json": b'{"model_type": "llama", "num_hidden_layers": 2}', **files}


async def serving(root: Path, source="org/m", staging_plan=lambda _source: None, allow=True) -> PeerServer:
    server = PeerServer(str(root), staging_plan, "127.0.0.1", 0)
    await server.start()
    if allow:
        server.allow(ServeWeights(epoch=1, source=source, node="b", ticket=TICKET))
    return server


def peer(server: PeerServer, node="a") -> StagePeer:
    return StagePeer(node=node, url=f"http://127.0.0.1:{server.port}", ticket=TICKET)


async def stage(root: Path, peers: list[StagePeer], source="org/m", patience=None) -> list[dict]:
    """Stage `source` on a node whose weights root is `root`; returns the statuses it sent, the last one final."""
    sent: list[dict] = []

    async def send(raw: bytes) -> bool:
        sent.append(msgspec.json.decode(raw))
        return True

    staging = Staging(str(root), send, lambda: None, hub_endpoint=NO_HUB, report_seconds=0.05, attempts=3)
    staging.begin(StageWeights(epoch=1, source=source, peers=peers))
    if patience is not None:
        staging.stages[source].patience_until = patience
    while staging.stages[source].state == "fetching":
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.01)
    return sent


def test_a_node_copies_a_peers_weights_into_the_cache_engines_read_and_asks_the_hub_nothing(tmp_path):
    files = weights()

    async def scenario():
        hold(tmp_path / "a", "org/m", files)
        server = await serving(tmp_path / "a")
        try:
            return await stage(tmp_path / "b", [peer(server)])
        finally:
            await server.stop()

    sent = asyncio.run(scenario())
    final = sent[-1]
    assert final["state"] == "ready" and final["bytes_done"] == final["bytes_total"] == sum(map(len, files.values()))
    assert "from a" in final["message"] and "the hub" not in final["message"]
    assert any(s["state"] == "fetching" for s in sent[:-1])
    for name, content in files.items():  # where an engine (the hub's own client) looks, offline
        path = hf_hub_download("org/m", name, cache_dir=tmp_path / "b" / "hub", local_files_only=True)
        assert Path(path).read_bytes() == content


def test_a_peer_that_refuses_or_serves_corrupt_bytes_is_passed_over_for_another_and_nothing_unverified_is_kept(
    tmp_path,
):
    files = weights()
    plan = hold(tmp_path / "bad", "org/m", files)
    hold(tmp_path / "good", "org/m", files)
    shard = next(f for f in plan.files if f.name.endswith("00001.safetensors"))
    corrupt = tmp_path / "bad" / "hub" / "models--org--m" / "blobs" / shard.blob_name
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))

    async def scenario(peers_of, root):
        bad, good, stranger = (
            await serving(tmp_path / "bad"),
            await serving(tmp_path / "good"),
            await serving(tmp_path / "good", allow=False),
        )
        try:
            return await stage(root, peers_of(bad, good, stranger), patience=0)
        finally:
            for server in (bad, good, stranger):
                await server.stop()

    peers = lambda bad, good, stranger: [peer(stranger, "c"), peer(bad, "a"), peer(good, "d")]  # noqa: E731
    sent = asyncio.run(scenario(peers, tmp_path / "b"))
    assert sent[-1]["state"] == "ready" and "from d" in sent[-1]["message"]
    blob = tmp_path / "b" / "hub" / "models--org--m" / "blobs" / shard.blob_name
    assert blob.read_bytes() == files[shard.name]

    # With only the corrupt peer (and no hub to fall back on) the stage fails, and the file is not there at all.
    sent = asyncio.run(scenario(lambda bad, good, stranger: [peer(bad, "a")], tmp_path / "b2"))
    assert sent[-1]["state"] == "failed"
    assert not (tmp_path / "b2" / "hub" / "models--org--m" / "blobs" / shard.blob_name).exists()
    assert not (tmp_path / "b2" / "hub" / "models--org--m" / "snapshots").exists()


def test_a_stage_follows_a_peer_that_is_still_fetching_the_files_instead_of_asking_the_hub(tmp_path):
    files = weights(sizes=(1 << 20, 1 << 20, 1 << 20))
    plan = plan_of("org/m", files)
    entry = tmp_path / "a" / "hub" / "models--org--m" / "blobs"

    async def scenario():
        fetching = True
        server = await serving(tmp_path / "a", staging_plan=lambda _source: plan if fetching else None)
        entry.mkdir(parents=True)

        async def arrive():
            nonlocal fetching
            for f in plan.files:  # the peer's own stage verifies and renames each file in turn
                await asyncio.sleep(0.3)
                (entry / f.blob_name).write_bytes(files[f.name])
            fetching = False

        try:
            sent, _ = await asyncio.gather(stage(tmp_path / "b", [peer(server)]), arrive())
            return sent
        finally:
            await server.stop()

    sent = asyncio.run(scenario())
    assert sent[-1]["state"] == "ready" and "from a" in sent[-1]["message"]


def test_the_weights_server_serves_only_the_copies_it_was_told_of_and_only_verified_blobs(tmp_path):
    files = weights()
    plan = hold(tmp_path, "org/m", files)
    assert plan_on_disk(str(tmp_path), "org/m", "main") == plan

    async def scenario():
        server = await serving(tmp_path)
        base = f"http://127.0.0.1:{server.port}/weights"
        blob = plan.files[-1].blob_name
        try:
            async with httpx.AsyncClient() as client:
                auth = {"Authorization": f"Bearer {TICKET}"}
                return [
                    (await client.get(f"{base}/blob", params={"source": "org/m", "digest": blob})).status_code,
                    (await client.get(f"{base}/blob", params={"source": "org/other", "digest": blob}, headers=auth)).status_code,
                    (await client.get(f"{base}/blob", params={"source": "org/m", "digest": "../x"}, headers=auth)).status_code,
                    (await client.get(f"{base}/blob", params={"source": "org/m", "digest": "0" * 64}, headers=auth)).status_code,
                    (await client.get(f"{base}/blob", params={"source": "org/m", "digest": blob}, headers={**auth, "Range": "bytes=10-19"})),
                    (await client.get(f"{base}/plan", params={"source": "org/m"}, headers=auth)).json(),
                ]  # fmt: skip
        finally:
            await server.stop()

    no_ticket, other_source, bad_digest, absent, ranged, listed = asyncio.run(scenario())
    assert (no_ticket, other_source, bad_digest, absent) == (401, 401, 400, 404)
    assert ranged.status_code == 206 and ranged.content == files[plan.files[-1].name][10:20]
    assert listed["commit"] == plan.commit and [f["name"] for f in listed["files"]] == [f.name for f in plan.files]


@pytest.mark.parametrize("partial_bytes", [1 << 20])
def test_a_cut_copy_resumes_from_its_partial_file(tmp_path, partial_bytes):
    files = weights()
    plan = hold(tmp_path / "a", "org/m", files)
    shard = next(f for f in plan.files if f.name.endswith("00001.safetensors"))
    blobs = tmp_path / "b" / "hub" / "models--org--m" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{shard.blob_name}.partial").write_bytes(files[shard.name][:partial_bytes])

    async def scenario():
        server = await serving(tmp_path / "a")
        try:
            return await stage(tmp_path / "b", [peer(server)])
        finally:
            await server.stop()

    sent = asyncio.run(scenario())
    assert sent[-1]["state"] == "ready"
    first = next(s for s in sent if s["bytes_total"])
    assert first["bytes_done"] >= partial_bytes  # counted as done from the start: it is not fetched again
    assert (blobs / shard.blob_name).read_bytes() == files[shard.name]
    assert not (blobs / f"{shard.blob_name}.partial").exists()


def test_a_path_source_is_checked_where_it_is_and_never_copied(tmp_path):
    (tmp_path / "models" / "m").mkdir(parents=True)

    async def scenario(source):
        return await stage(tmp_path / "root", [], source=source)

    sent = asyncio.run(scenario(str(tmp_path / "models" / "m")))
    assert sent[-1]["state"] == "ready" and sent[-1]["path"] == str(tmp_path / "models" / "m")
    assert "nothing copied" in sent[-1]["message"] and not (tmp_path / "root" / "hub").exists()
    sent = asyncio.run(scenario(str(tmp_path / "models" / "gone")))
    assert sent[-1]["state"] == "failed" and "does not exist on this node" in sent[-1]["message"]


@pytest.mark.parametrize(
    ("name", "kind", "digest"),
    [("../escape", "sha256", "a" * 64), ("/abs", "sha256", "a" * 64), ("a//b", "sha256", "a" * 64),
     ("model.safetensors", "sha256", "../../x"), ("model.safetensors", "md5", "a" * 32),
     ("config.json", "git-sha1", "A" * 40)],
)  # fmt: skip
def test_a_plan_naming_paths_outside_the_cache_or_digests_that_are_none_is_refused(name, kind, digest):
    with pytest.raises(TransferError, match="refusing"):
        HubFile(name, 1, Digest(kind, digest))
