"""Repositories for the mock hub: valid safetensors checkpoints of random bytes, of any size, made in seconds."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "vocab_size": 256,
}
_WRITE = 64 << 20


def make_safetensors_repo(root: str | os.PathLike, repo_id: str, total_bytes: int, files: int = 4, seed: int = 0):
    """Write `repo_id` under `root` as `files` safetensors shards of one BF16 tensor each, about `total_bytes` in
    all, plus its config.json; returns the repository's folder."""
    folder = Path(root) / repo_id
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 64}))
    rng = np.random.default_rng(seed)
    per_file = max(2, total_bytes // files) // 2 * 2  # whole BF16 elements
    for i in range(files):
        header = json.dumps(
            {"weight": {"dtype": "BF16", "shape": [per_file // 2], "data_offsets": [0, per_file]}}
        ).encode()
        header += b" " * (-len(header) % 8)
        with open(folder / f"model-{i + 1:05d}-of-{files:05d}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            left = per_file
            while left:
                n = min(_WRITE, left)
                f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
                left -= n
    return folder
