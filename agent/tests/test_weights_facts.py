"""The agent's weights reports carry what the weights' headers say: exact tensor bytes, dtype, parameters, shape."""

import asyncio
import json
import os
import threading

import gguf
import numpy as np
import pytest

from agent.weights.facts import HeaderCache, config_shape, header_facts
from agent.weights.inventory import WeightsInventory
from nodewire import protocol
from nodewire.protocol import Heartbeat
from nodewire.tests.test_weights_headers import random_tensors, write_safetensors
from nodewire.weights.messages import WeightsReport
from tests.tiny_gguf import write_tiny_llama

pytestmark = pytest.mark.timeout(30)

CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 64,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def hub_snapshot(root, repo_id, revision="abc123", *, shards=2, config=CONFIG, main=True, seed=0):
    """A Hugging Face cache entry as a download leaves it: blobs, a snapshot of symlinks to them, refs/main.

    Returns the tensors' byte count, as written (the data after each file's header).
    """
    entry = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = entry / "blobs", entry / "snapshots" / revision
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    total, weight_map = 0, {}
    for k in range(1, shards + 1):
        name = f"model-{k:05d}-of-{shards:05d}.safetensors"
        tensors = random_tensors(rng, {f"layers.{k}.w": ("BF16", (64, 64)), f"layers.{k}.norm": ("F32", (64,))})
        total += write_safetensors(blobs / f"blob{revision}{k}", tensors)
        os.symlink(blobs / f"blob{revision}{k}", snapshot / name)
        weight_map |= {tensor: name for tensor in tensors}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if config is not None:
        (snapshot / "config.json").write_text(json.dumps(config))
    if main:
        (entry / "refs").mkdir(exist_ok=True)
        (entry / "refs" / "main").write_text(revision)
    return total


def test_a_hub_cache_entry_is_reported_with_its_exact_tensor_bytes_dtypes_and_config_shape(tmp_path):
    expected = hub_snapshot(tmp_path, "org/m")
    (report,) = asyncio.run(WeightsInventory(str(tmp_path)).scan_now())
    header = report.header
    assert header is not None and header.format == "safetensors"
    assert header.tensor_bytes == expected  # exact: the bytes after the headers, not the files' sizes
    assert report.size_bytes > expected
    assert header.bytes_by_dtype == {"BF16": 2 * 64 * 64 * 2, "F32": 2 * 64 * 4}
    assert (header.parameters, header.tensors) == (2 * (64 * 64 + 64), 4)
    shape = header.shape
    assert (shape.architecture, shape.layers, shape.heads, shape.kv_heads) == ("llama", 2, 4, 2)
    assert (shape.embedding, shape.context_length, shape.sliding_window) == (64, 4096, None)


def test_a_gguf_file_is_reported_with_exactly_the_tensor_bytes_the_file_holds(tmp_path):
    (tmp_path / "gguf").mkdir()
    path = write_tiny_llama(tmp_path / "gguf" / "tiny.gguf")
    # The file's own account, by the gguf package's reader: every tensor's bytes.
    reader = gguf.GGUFReader(str(path))
    expected = sum(int(t.n_bytes) for t in reader.tensors)
    (report,) = asyncio.run(WeightsInventory(str(tmp_path)).scan_now())
    assert report.source == "gguf/tiny.gguf"
    assert report.header.format == "gguf" and report.header.tensor_bytes == expected
    assert report.header.bytes_by_dtype == {"F32": expected}
    assert report.header.parameters == sum(int(t.n_elements) for t in reader.tensors)
    shape = report.header.shape
    assert (shape.architecture, shape.layers, shape.heads, shape.kv_heads, shape.context_length) == (
        "llama",
        2,
        4,
        4,
        2048,
    )


def test_the_report_survives_the_protocol_gate_whole(tmp_path):
    hub_snapshot(tmp_path, "org/m")
    write_tiny_llama(tmp_path / "tiny.gguf")
    reports = asyncio.run(WeightsInventory(str(tmp_path)).scan_now())
    beat = Heartbeat(gpus=[], weights=reports)
    assert protocol.decode_agent_message(protocol.encode(beat)) == beat
    assert all(r.header is not None for r in reports)


def test_refs_main_names_the_snapshot_read_else_the_newest(tmp_path):
    hub_snapshot(tmp_path, "org/m", "old", shards=1, seed=1)
    new = hub_snapshot(tmp_path, "org/m", "new", shards=3, seed=2)
    entry = tmp_path / "hub" / "models--org--m"
    (entry / "refs" / "main").write_text("old")
    old = header_facts(str(entry)).tensor_bytes
    assert old != new
    (entry / "refs" / "main").unlink()
    os.utime(entry / "snapshots" / "new", ns=(2 * 10**18, 2 * 10**18))
    assert header_facts(str(entry)).tensor_bytes == new


def test_weights_whose_headers_cannot_be_read_are_reported_without_facts(tmp_path):
    hub_snapshot(tmp_path, "org/m", shards=1)
    snapshot = tmp_path / "hub" / "models--org--m" / "snapshots" / "abc123"
    (snapshot / "model-00001-of-00001.safetensors").unlink()  # a download in progress: the index names it
    (tmp_path / "broken.gguf").write_bytes(b"GGUF")
    reports = asyncio.run(WeightsInventory(str(tmp_path)).scan_now())
    assert [(r.source, r.header) for r in reports] == [("broken.gguf", None), ("org/m", None)]


def test_headers_are_read_once_per_modification_and_again_when_the_weights_change(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    cache = HeaderCache()
    first = cache.facts(str(path))
    assert cache.facts(str(path)) == first and cache.reads == 1
    write_tiny_llama(path, seed=1)
    os.utime(path, ns=(3 * 10**18, 3 * 10**18))
    assert cache.facts(str(path)) == first and cache.reads == 2  # same shape, same bytes: read again all the same
    path.write_bytes(b"GGUF")  # replaced by something unreadable
    assert cache.facts(str(path)) is None and cache.reads == 3
    cache.keep_only(set())
    assert cache.facts(str(tmp_path / "gone.gguf")) is None and cache.reads == 3


def test_headers_are_read_in_the_scan_thread_and_never_again_while_nothing_changes(tmp_path):
    hub_snapshot(tmp_path, "org/m")
    inventory = WeightsInventory(str(tmp_path), scan_every=1)
    threads: list[str] = []

    class Recording(HeaderCache):
        def facts(self, path):
            threads.append(threading.current_thread().name)
            return super().facts(path)

    inventory.headers = Recording()

    async def scenario():
        await inventory.scan_now()
        loop_thread = threading.current_thread().name
        for _ in range(4):
            inventory.for_heartbeat()
            if inventory._scan is not None:
                await inventory._scan
        return loop_thread

    loop_thread = asyncio.run(scenario())
    assert threads and loop_thread not in threads
    assert inventory.headers.reads == 1  # five scans, one read: nothing changed


def test_a_config_window_is_reported_only_where_the_shape_can_say_which_layers_slide(tmp_path):
    def shape(**config):
        (tmp_path / "config.json").write_text(json.dumps(CONFIG | config))
        return config_shape(tmp_path / "config.json")

    assert shape(model_type="mistral", sliding_window=4096).sliding_window == 4096
    assert shape(model_type="gemma2", sliding_window=4096).sliding_window == 4096  # alternation by architecture
    assert shape(model_type="qwen2", sliding_window=4096, use_sliding_window=True).sliding_window is None
    assert shape(sliding_window=4096, layer_types=["sliding_attention", "full_attention"]).sliding_window is None
    (tmp_path / "config.json").write_text("[1]")
    assert config_shape(tmp_path / "config.json") is None


@pytest.mark.parametrize(
    ("header", "problem"),
    [
        ({"tensor_bytes": -1}, r"Expected `int` >= 0 - at `\$.weights\[0\].header.tensor_bytes`"),
        ({"format": "bin"}, r"at `\$.weights\[0\].header.format`"),
        (
            {"bytes_by_dtype": {"F16": 3}},
            r"bytes_by_dtype adds up to 3, not tensor_bytes 8 - at `\$.weights\[0\].header`",
        ),
        ({"shape": {"layers": 0}}, r"Expected `int` >= 1 - at `\$.weights\[0\].header.shape.layers`"),
        ({"shape": {"kv_heads_per_layer": [1, -1]}}, r"at `\$.weights\[0\].header.shape.kv_heads_per_layer\[1\]`"),
        ({"parameters": "8"}, r"Expected `int`, got `str` - at `\$.weights\[0\].header.parameters`"),
    ],
)
def test_a_bad_header_report_is_refused_naming_the_field(header, problem):
    good = {"format": "gguf", "tensor_bytes": 8, "parameters": 4, "tensors": 1, "bytes_by_dtype": {"F16": 8}}
    weights = [{"source": "a", "path": "/p", "size_bytes": 9, "header": good | header}]
    with pytest.raises(protocol.ProtocolError, match=problem):
        protocol.decode_agent_message(json.dumps({"type": "heartbeat", "v": 1, "gpus": [], "weights": weights}))


def test_reports_of_agents_that_predate_header_facts_are_still_accepted():
    raw = {"type": "hello", "v": 1, "node": "n", "version": "0.1", "address": "a", "gpus": []}
    raw["weights"] = [{"source": "org/m", "path": "/w/hub/models--org--m", "size_bytes": 5}]
    hello = protocol.decode_agent_message(json.dumps(raw))
    assert hello.weights == [WeightsReport(source="org/m", path="/w/hub/models--org--m", size_bytes=5, header=None)]
