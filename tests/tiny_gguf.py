"""A tiny llama-architecture model in GGUF with random weights, for running a real llama.cpp server in tests.

Two layers of 64 dimensions and a byte-level BPE vocabulary (GPT-2's: every
byte is a token, plus a few merges and one end-of-text token): about 0.5 MB,
loaded by `llama-server` in well under a second on a CPU. Its answers are
noise, so tests assert their shape, not their text.

The end-of-text token's output row is zero, so its logit is always 0 while
random rows give some other token a larger one: a greedy reply never stops
early, and `max_tokens` decides its length (finish_reason "length").
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

EMBEDDING = 64
LAYERS = 2
HEADS = 4
FEED_FORWARD = 128
CONTEXT = 2048
END_OF_TEXT = "<|endoftext|>"
MERGES = ("Ġ t", "h e", "i n", "e r", "a n", "Ġ a", "o n", "r e")


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order (the vocabulary llama.cpp's BPE expects)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + shifted)
            shifted += 1
    return [symbols[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[int]]:
    """Tokens and their types: the 256 bytes, one token per merge, and the end-of-text control token."""
    tokens = byte_symbols() + ["".join(m.split(" ")) for m in MERGES] + [END_OF_TEXT]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL]
    return tokens, [int(t) for t in types]


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    """Write the model to `path` (same seed, same bytes) and return the path."""
    rng = np.random.default_rng(seed)
    tokens, types = vocabulary()
    eot = len(tokens) - 1

    def weights(*shape: int) -> np.ndarray:
        # numpy's shape is ggml's reversed: (rows, columns) is ggml {columns, rows}.
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("llmgw tiny llama (random weights)")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(EMBEDDING)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FEED_FORWARD)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(EMBEDDING // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(eot)
    writer.add_eos_token_id(eot)
    writer.add_add_bos_token(False)

    writer.add_tensor("token_embd.weight", weights(len(tokens), EMBEDDING))
    for layer in range(LAYERS):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{name}.weight", weights(EMBEDDING, EMBEDDING))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_gate.weight", weights(FEED_FORWARD, EMBEDDING))
        writer.add_tensor(f"{block}.ffn_up.weight", weights(FEED_FORWARD, EMBEDDING))
        writer.add_tensor(f"{block}.ffn_down.weight", weights(EMBEDDING, FEED_FORWARD))
    writer.add_tensor("output_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
    output = weights(len(tokens), EMBEDDING)
    output[eot] = 0.0  # see the module docstring: replies run to max_tokens
    writer.add_tensor("output.weight", output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
