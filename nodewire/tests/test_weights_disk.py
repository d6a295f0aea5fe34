"""Where weights live under the root, what a scan finds, when the agent scans, and what it agrees to delete."""

import asyncio
import os

import pytest

from agent.weights.inventory import WeightsInventory
from nodewire.protocol import RemoveWeights
from nodewire.weights import disk
from nodewire.weights.disk import RefusedRemoval, removable_path, remove, scan, weights_key, weights_path
from nodewire.weights.messages import WeightsReport


@pytest.mark.parametrize(
    ("engine", "source", "expected"),
    [
        ("vllm", "meta-llama/Llama-3.1-8B-Instruct", "/w/hub/models--meta-llama--Llama-3.1-8B-Instruct"),
        ("sglang", "Qwen/Qwen2.5-7B", "/w/hub/models--Qwen--Qwen2.5-7B"),
        ("mock", "org/m", "/w/hub/models--org--m"),
        ("vllm", "gpt2", "/w/hub/models--gpt2"),
        ("llamacpp", "gguf/llama-8b.Q4_K_M.gguf", "/w/gguf/llama-8b.Q4_K_M.gguf"),
        ("llamacpp", "/w/gguf/x.gguf", "/w/gguf/x.gguf"),
        ("vllm", "/w/local/llama", "/w/local/llama"),  # a local folder is a path, not a repository
    ],
)
def test_each_engine_finds_its_weights_where_the_layout_says(engine, source, expected):
    assert weights_path("/w", engine, source) == expected


@pytest.mark.parametrize("source", ["/elsewhere/x.gguf", "../x.gguf", "gguf/../../x.gguf"])
def test_a_gguf_source_outside_the_root_has_no_place_in_it(source):
    with pytest.raises(ValueError, match="is not inside the weights root /w"):
        weights_path("/w", "llamacpp", source)


def test_keys_are_what_a_node_reports():
    assert weights_key("vllm", " org/m ") == "org/m"
    assert weights_key("llamacpp", "./gguf//x.gguf") == "gguf/x.gguf"
    assert weights_key("vllm", "/data//llama/") == "/data/llama"
    assert disk.repo_id_of(disk.cache_dir_name("org/name-v2")) == "org/name-v2"
    assert disk.repo_id_of("datasets--org--d") is None


def make_hf_cache(root, repo_id, blob_bytes=1000):
    """A Hugging Face cache entry: a blob, and a snapshot file that links to it."""
    entry = root / "hub" / disk.cache_dir_name(repo_id)
    (entry / "blobs").mkdir(parents=True)
    (entry / "blobs" / "abc123").write_bytes(b"x" * blob_bytes)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("0123")
    (entry / "snapshots" / "0123").mkdir(parents=True)
    os.symlink("../../blobs/abc123", entry / "snapshots" / "0123" / "model.safetensors")
    return entry


def test_a_scan_finds_hub_entries_and_gguf_files_counting_each_byte_once(tmp_path):
    entry = make_hf_cache(tmp_path, "org/m")
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "small.gguf").write_bytes(b"g" * 300)
    (tmp_path / "notes.txt").write_text("not weights")
    assert scan(str(tmp_path)) == [
        disk.WeightsOnDisk("gguf/small.gguf", str(tmp_path / "gguf" / "small.gguf"), 300),
        disk.WeightsOnDisk("org/m", str(entry), 1004),  # the blob and refs/main; the symlink adds nothing
    ]


@pytest.fixture
def root_and_outside(tmp_path):
    root, outside = tmp_path / "weights", tmp_path / "precious"
    root.mkdir()
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    return root, outside


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("{root}/../precious", "contains '..'"),
        ("{root}/hub/../../precious", "contains '..'"),
        ("{outside}", "is not inside the weights root"),
        ("{root}/escape", "resolves to .*precious, outside the weights root"),
        ("{root}", "is the weights root itself"),
        ("{root}/", "is the weights root itself"),
        ("", "the path is empty"),
    ],
)
def test_removal_outside_the_root_is_refused_and_nothing_is_deleted(root_and_outside, path, problem):
    root, outside = root_and_outside
    os.symlink(outside, root / "escape")  # a symlink inside the root to a folder outside it
    entry = make_hf_cache(root, "org/m")
    with pytest.raises(RefusedRemoval, match=problem):
        remove(str(root), path.format(root=root, outside=outside))
    assert (outside / "keep.txt").read_text() == "keep"
    assert entry.is_dir() and (root / "escape").is_symlink()


def test_a_symlink_inside_the_root_to_other_weights_is_refused(root_and_outside):
    root, _ = root_and_outside
    entry = make_hf_cache(root, "org/m")
    os.symlink(entry, root / "alias")
    with pytest.raises(RefusedRemoval, match="goes through a symlink"):
        remove(str(root), str(root / "alias"))
    assert entry.is_dir()


def test_a_real_folder_inside_the_root_is_removed(root_and_outside):
    root, outside = root_and_outside
    entry = make_hf_cache(root, "org/m")
    other = make_hf_cache(root, "org/other")
    assert remove(str(root), str(entry)) == f"removed {entry}"
    assert not entry.exists() and other.is_dir() and (outside / "keep.txt").exists()
    assert remove(str(root), str(entry)) == f"{entry} was already absent"


def test_the_root_may_be_named_through_a_symlink(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    entry = make_hf_cache(real, "org/m")
    assert removable_path(str(tmp_path / "link"), str(tmp_path / "link" / "hub" / entry.name)) == str(entry)


def test_the_inventory_reports_weights_at_hello_then_only_changes_every_n_heartbeats(tmp_path):
    make_hf_cache(tmp_path, "org/m")
    inventory = WeightsInventory(str(tmp_path), scan_every=3)

    async def beat():
        sent = inventory.for_heartbeat()
        if inventory._scan is not None:
            await inventory._scan  # let the scan this heartbeat started finish, as the next interval would
        return sent

    async def scenario():
        await inventory.scan_now()
        hello = inventory.for_hello()
        beats = [await beat() for _ in range(3)]  # nothing changed: nothing sent; the third starts a scan
        make_hf_cache(tmp_path, "org/new")
        beats += [await beat() for _ in range(3)]  # the disk changed, the scan at beat 6 sees it
        beats.append(await beat())  # its result goes out with the next heartbeat
        inventory.changed()  # e.g. a shard became ready: scan at the next heartbeat
        (tmp_path / "x.gguf").write_bytes(b"1")
        beats += [await beat(), await beat()]
        return hello, beats

    hello, beats = asyncio.run(scenario())
    assert [w.source for w in hello] == ["org/m"]
    assert beats[:6] == [None] * 6
    assert [w.source for w in beats[6]] == ["org/m", "org/new"]
    assert beats[7] is None
    assert [w.source for w in beats[8]] == ["org/m", "org/new", "x.gguf"]
    assert all(isinstance(w, WeightsReport) for w in beats[8])


def test_without_a_root_nothing_is_reported_and_removal_is_refused():
    inventory = WeightsInventory(None)
    assert asyncio.run(inventory.scan_now()) is None and inventory.for_heartbeat() is None
    status = asyncio.run(inventory.remove(RemoveWeights(epoch=1, source="org/m", path="/w/hub/models--org--m")))
    assert (status.removed, status.message) == (False, "this agent has no weights root")


def test_a_root_that_cannot_be_read_leaves_the_weights_unknown_instead_of_stopping_the_agent(tmp_path):
    class UnreadableRoot(WeightsInventory):
        """A root the disk refuses (an NFS mount gone stale); tests run as root, so permissions cannot do it."""

        def _read(self, staging=()):
            raise PermissionError(13, "Permission denied", self.root)

    inventory = UnreadableRoot(str(tmp_path), scan_every=1)
    assert asyncio.run(inventory.scan_now()) is None
    assert inventory.for_hello() is None  # unknown: the control plane keeps what it knew
