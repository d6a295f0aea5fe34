"""Weights sizes from their headers: exact on generated files, and a clear error for every kind of bad file."""

import json
import struct
import tracemalloc

import gguf
import numpy as np
import pytest

from nodewire.weights.gguf import ggml_bits_per_weight, read_gguf
from nodewire.weights.header_types import WeightsHeaderError
from nodewire.weights.headers import SAFETENSORS_INDEX, read_weights_headers
from tests.tiny_gguf import write_tiny_llama

# No file here is big: a read that hangs or loops is a failure, not a slow pass.
pytestmark = pytest.mark.timeout(20)

NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "U8": np.uint8, "I64": np.int64}


def write_safetensors(path, tensors, metadata=None, *, order=None):
    """A safetensors file written by hand (8-byte length, JSON header, data); returns the tensors' byte count."""
    header, blobs, offset = {}, [], 0
    for name in order or tensors:
        dtype, array = tensors[name]
        raw = np.ascontiguousarray(array, dtype=NUMPY_DTYPES.get(dtype, np.uint16)).tobytes()
        header[name] = {"dtype": dtype, "shape": list(np.shape(array)), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header with spaces to 8 bytes
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return offset


def random_tensors(rng, spec):
    return {name: (dtype, rng.standard_normal(shape)) for name, (dtype, shape) in spec.items()}


def test_a_safetensors_file_counts_exactly_its_tensor_bytes(tmp_path):
    rng = np.random.default_rng(1)
    tensors = random_tensors(
        rng,
        {
            "model.embed_tokens.weight": ("BF16", (100, 64)),
            "model.layers.0.self_attn.q_proj.weight": ("F16", (64, 64)),
            "model.norm.weight": ("F32", (64,)),
            "lm_head.weight": ("BF16", (100, 64)),
        },
    )
    path = tmp_path / "model.safetensors"
    data_bytes = write_safetensors(path, tensors, {"format": "pt"})
    header = read_weights_headers(path)
    assert header.format == "safetensors"
    assert header.total_bytes == data_bytes == 100 * 64 * 2 * 2 + 64 * 64 * 2 + 64 * 4
    assert dict(header.bytes_by_dtype) == {"BF16": 25600, "F16": 8192, "F32": 256}
    assert header.elements == 100 * 64 * 2 + 64 * 64 + 64
    assert header.tensors == 4
    assert header.metadata == {"format": "pt"}
    # What the file holds after its header is exactly the tensors.
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert path.stat().st_size - 8 - length == header.total_bytes


def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path):
    rng = np.random.default_rng(2)
    expected = 0
    weight_map = {}
    for part in (1, 2, 3):
        name = f"model-{part:05d}-of-00003.safetensors"
        tensors = random_tensors(rng, {f"layer.{part}.{t}": ("BF16", (32 * part, 48)) for t in ("a", "b")})
        expected += write_safetensors(tmp_path / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))
    (tmp_path / SAFETENSORS_INDEX).write_text(
        json.dumps({"metadata": {"total_size": expected}, "weight_map": weight_map})
    )
    (tmp_path / "config.json").write_text("{}")

    header = read_weights_headers(tmp_path)
    assert header.total_bytes == expected == sum(2 * 32 * p * 48 * 2 for p in (1, 2, 3))
    assert len(header.files) == 3 and header.tensors == 6
    # One shard named directly brings its siblings along.
    assert read_weights_headers(tmp_path / "model-00002-of-00003.safetensors").total_bytes == expected


def test_a_folder_without_an_index_reads_every_safetensors_file(tmp_path):
    rng = np.random.default_rng(3)
    a = write_safetensors(tmp_path / "a.safetensors", random_tensors(rng, {"x": ("F32", (8, 8))}))
    b = write_safetensors(tmp_path / "b.safetensors", random_tensors(rng, {"y": ("F16", (8, 16))}))
    assert read_weights_headers(tmp_path).total_bytes == a + b


def write_quantized_gguf(path):
    """A GGUF with float and quantized tensors (Q8_0, Q4_K, Q6_K) and a model shape in its metadata."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(3)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    writer.add_embedding_length(512)
    writer.add_context_length(8192)
    writer.add_token_list([f"t{i}" for i in range(300)])  # an array the walk skips, lengths checked
    rng = np.random.default_rng(4)
    writer.add_tensor("token_embd.weight", rng.standard_normal((300, 512)).astype(np.float16))
    writer.add_tensor("output_norm.weight", np.ones(512, dtype=np.float32))
    for qtype, rows in (
        (gguf.GGMLQuantizationType.Q8_0, 64),
        (gguf.GGMLQuantizationType.Q4_K, 128),
        (gguf.GGMLQuantizationType.Q6_K, 96),
    ):
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 255, size=(rows, 512 // block * type_size), dtype=np.uint8)
        writer.add_tensor(f"blk.0.{qtype.name}.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_tensor_bytes_follow_the_quantization_blocks_exactly(tmp_path):
    path = write_quantized_gguf(tmp_path / "m.gguf")
    header = read_weights_headers(path)
    reference = gguf.GGUFReader(path)  # the package's own reader, as a second opinion on each tensor
    assert (
        header.total_bytes
        == sum(int(t.n_bytes) for t in reference.tensors)
        == sum(t.data.nbytes for t in reference.tensors)
    )
    assert dict(header.bytes_by_dtype) == {
        "F16": 300 * 512 * 2,
        "F32": 512 * 4,
        "Q8_0": 64 * 512 // 32 * 34,
        "Q4_K": 128 * 512 // 256 * 144,
        "Q6_K": 96 * 512 // 256 * 210,
    }
    shape = header.shape
    assert (shape.architecture, shape.layers, shape.heads, shape.kv_heads, shape.embedding, shape.context_length) == (
        "llama",
        3,
        8,
        2,
        512,
        8192,
    )


def test_the_tiny_llama_of_the_suite_reads_as_the_package_reads_it(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    header = read_gguf(path)
    reference = gguf.GGUFReader(path)
    assert header.total_bytes == sum(t.data.nbytes for t in reference.tensors)
    assert header.tensors == len(reference.tensors)
    assert header.shape.layers == 2 and header.shape.kv_heads == 4


def test_a_split_gguf_is_read_with_all_its_parts(tmp_path):
    single = write_quantized_gguf(tmp_path / "single.gguf")
    one = read_gguf(single).total_bytes
    first = single.rename(tmp_path / "m-00001-of-00002.gguf")
    (tmp_path / "m-00002-of-00002.gguf").write_bytes(first.read_bytes())
    assert read_weights_headers(tmp_path).total_bytes == 2 * one
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(WeightsHeaderError, match="m-00002-of-00002.gguf is missing"):
        read_weights_headers(first)


def test_ggml_bits_per_weight_come_from_the_block_sizes():
    assert ggml_bits_per_weight("Q4_K") == 4.5
    assert ggml_bits_per_weight("q8_0") == 8.5
    assert ggml_bits_per_weight("Q4_K_M") is None


def gguf_prefix(tensor_count=0, kv_count=0, version=3):
    return struct.pack("<IIQQ", gguf.GGUF_MAGIC, version, tensor_count, kv_count)


def gguf_string(text):
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


BAD_FILES = {
    "empty": (b"", "too short"),
    "safetensors shorter than its length": (struct.pack("<Q", 100) + b"{}", "runs past the end"),
    "absurd safetensors header length": (struct.pack("<Q", 2**63) + b"{}" * 8, "above safetensors' limit"),
    "safetensors header not JSON": (struct.pack("<Q", 8) + b"not json", "not JSON"),
    "safetensors header a list": (struct.pack("<Q", 8) + b"[1,2,3] ", "not a JSON object"),
    "tensor outside the data": (
        struct.pack("<Q", 64)
        + json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode().ljust(64)
        + b"\0" * 8,
        "outside the file's 8 data bytes",
    ),
    "bytes not matching the shape": (
        struct.pack("<Q", 64)
        + json.dumps({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}).encode().ljust(64)
        + b"\0" * 16,
        "needs 12",
    ),
    "tensor without dtype": (struct.pack("<Q", 16) + b'{"x": {"a": 1}} ', "lacks dtype"),
}
BAD_GGUF = {
    "wrong magic": (b"GGUX" + b"\0" * 40, "no GGUF magic"),
    "unsupported version": (gguf_prefix(version=9) + b"\0" * 8, "version 9"),
    "header cut short": (gguf_prefix(kv_count=1) + gguf_string("general.architecture")[:10], "cannot fit"),
    "absurd tensor count": (gguf_prefix(tensor_count=2**40), "tensor count"),
    # gguf.GGUFReader loops without end on this one (the array's length points past the file).
    "array longer than the file": (
        gguf_prefix(kv_count=1) + gguf_string("a") + struct.pack("<IIQ", 9, 4, 2**40),
        "a length",
    ),
    "string longer than the file": (
        gguf_prefix(kv_count=1) + gguf_string("a") + struct.pack("<IQ", 8, 2**50),
        "truncated",
    ),
    "unknown value type": (gguf_prefix(kv_count=1) + gguf_string("a") + struct.pack("<I", 77), "unknown value type 77"),
    "tensor of unknown type": (
        gguf_prefix(tensor_count=1) + gguf_string("w") + struct.pack("<IQIQ", 1, 32, 999, 0) + b"\0" * 64,
        "unknown ggml type 999",
    ),
    "tensor data past the end": (
        gguf_prefix(tensor_count=1) + gguf_string("w") + struct.pack("<IQQIQ", 2, 64, 64, 0, 0) + b"\0" * 64,
        "ends past the end of the file",
    ),
    "five dimensions": (
        gguf_prefix(tensor_count=1) + gguf_string("w") + struct.pack("<I", 5) + b"\0" * 64,
        "5 dimensions",
    ),
}


@pytest.mark.parametrize(("content", "named"), BAD_FILES.values(), ids=list(BAD_FILES))
def test_a_bad_safetensors_file_is_a_clear_error(tmp_path, content, named):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(WeightsHeaderError, match=named):
        read_weights_headers(path)


@pytest.mark.parametrize(("content", "named"), BAD_GGUF.values(), ids=list(BAD_GGUF))
def test_a_bad_gguf_file_is_a_clear_error_without_a_large_read(tmp_path, content, named):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    tracemalloc.start()
    try:
        with pytest.raises(WeightsHeaderError, match=named):
            read_weights_headers(path)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_a_truncated_real_gguf_is_refused(tmp_path):
    whole = write_quantized_gguf(tmp_path / "whole.gguf").read_bytes()
    for cut in (30, len(whole) // 3, len(whole) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(WeightsHeaderError, match="truncated|cannot fit"):
            read_weights_headers(path)


def test_missing_shards_and_unknown_files_are_named(tmp_path):
    with pytest.raises(WeightsHeaderError, match="no such file"):
        read_weights_headers(tmp_path / "absent.safetensors")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(WeightsHeaderError, match="not a .safetensors or .gguf file"):
        read_weights_headers(tmp_path / "weights.bin")
    with pytest.raises(WeightsHeaderError, match="no .safetensors or .gguf weights"):
        read_weights_headers(tmp_path)
    (tmp_path / SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": {"x": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(WeightsHeaderError, match="model-00001-of-00002.safetensors named by the index is missing"):
        read_weights_headers(tmp_path)
    (tmp_path / SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))
    with pytest.raises(WeightsHeaderError, match="same folder"):
        read_weights_headers(tmp_path)
