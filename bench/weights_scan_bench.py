"""What reading weights headers adds to an agent's scan of its weights root.

Builds a root of hub cache entries (each a snapshot of sharded safetensors
files, symlinks to blobs, an index and a config.json, as a download leaves it)
and GGUF files, then times, in alternating rounds, three scans of it:

* `plain`: the scan alone (nodewire/weights/disk.py `scan`: listing and sizes);
* `cold`: the scan with every header read (a fresh HeaderCache: the agent's
  first scan, or every weights path changed);
* `warm`: the scan with the headers known (the steady state: a stat per
  source says nothing changed).

    .venv/bin/python bench/weights_scan_bench.py [--entries 50] [--shards 8] [--ggufs 20] [--rounds 7]

The tensors are tiny (the headers are real, the data short): a scan reads
headers, never tensors, so the data's size does not change the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.weights.facts import HeaderCache  # noqa: E402
from nodewire.weights import disk  # noqa: E402
from tests.tiny_gguf import write_tiny_llama  # noqa: E402

TENSORS_PER_SHARD = 40  # a 70B checkpoint has ~720 tensors over 30 shards


def write_shard(path: Path, shard: int) -> None:
    header, offset = {}, 0
    for t in range(TENSORS_PER_SHARD):
        header[f"model.layers.{shard}.t{t}.weight"] = {
            "dtype": "BF16",
            "shape": [4, 4],
            "data_offsets": [offset, offset + 32],
        }
        offset += 32
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(offset))


def build_root(root: Path, entries: int, shards: int, ggufs: int) -> None:
    config = {"model_type": "llama", "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8}
    for e in range(entries):
        entry = root / "hub" / f"models--org--model{e}"
        blobs, snapshot = entry / "blobs", entry / "snapshots" / "rev"
        blobs.mkdir(parents=True)
        snapshot.mkdir(parents=True)
        weight_map = {}
        for k in range(1, shards + 1):
            name = f"model-{k:05d}-of-{shards:05d}.safetensors"
            write_shard(blobs / f"b{k}", k)
            os.symlink(blobs / f"b{k}", snapshot / name)
            weight_map[f"model.layers.{k}.t0.weight"] = name
        (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        (snapshot / "config.json").write_text(json.dumps(config))
        (entry / "refs").mkdir()
        (entry / "refs" / "main").write_text("rev")
    (root / "gguf").mkdir()
    for g in range(ggufs):
        write_tiny_llama(root / "gguf" / f"m{g}.gguf", seed=g)


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=50)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--ggufs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_root(root, args.entries, args.shards, args.ggufs)
        warm = HeaderCache()
        for w in disk.scan(str(root)):
            warm.facts(w.path)

        def plain() -> None:
            disk.scan(str(root))

        def with_headers(cache: HeaderCache) -> None:
            for w in disk.scan(str(root)):
                cache.facts(w.path)

        times: dict[str, list[float]] = {"plain": [], "cold": [], "warm": []}
        for _ in range(args.rounds):
            times["plain"].append(timed(plain))
            times["cold"].append(timed(lambda: with_headers(HeaderCache())))
            times["warm"].append(timed(lambda: with_headers(warm)))
    sources = args.entries + args.ggufs
    print(
        f"{args.entries} hub entries × {args.shards} shards + {args.ggufs} GGUF files; median of {args.rounds} rounds"
    )
    print("| scan | ms | ms per source |")
    print("|---|---:|---:|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} | {median / sources:.3f} |")


if __name__ == "__main__":
    main()
