"""Tests for ember.model.gguf_reader.GGUFFile, the start-up-fast GGUF reader, against gguf.GGUFReader."""

from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import default_gguf_path
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType

from ember.model.gguf_reader import GGUFFile, GGUFFormatError, GGUFTensor

# One value per scalar type, each chosen to survive its type exactly (float32 values included).
SCALARS = {
    "t.uint8": (255, GGUFValueType.UINT8),
    "t.int8": (-128, GGUFValueType.INT8),
    "t.uint16": (65535, GGUFValueType.UINT16),
    "t.int16": (-32768, GGUFValueType.INT16),
    "t.uint32": (2**32 - 1, GGUFValueType.UINT32),
    "t.int32": (-(2**31), GGUFValueType.INT32),
    "t.float32": (0.15625, GGUFValueType.FLOAT32),
    "t.bool": (True, GGUFValueType.BOOL),
    "t.string": ("héllo wörld ✓", GGUFValueType.STRING),
    "t.uint64": (2**64 - 1, GGUFValueType.UINT64),
    "t.int64": (-(2**63), GGUFValueType.INT64),
    "t.float64": (1e300, GGUFValueType.FLOAT64),
}
ARRAYS = {
    "t.tokens": (["<s>", "", "Ġhello", "你好", "🙂"], GGUFValueType.STRING),
    "t.scores": ([0.0, -1.5, 2.25], GGUFValueType.FLOAT32),
    "t.types": ([1, 3, 4, -7], GGUFValueType.INT32),
    "t.flags": ([True, False, True], GGUFValueType.BOOL),
    "t.u64s": ([0, 2**64 - 1], GGUFValueType.UINT64),
}
NESTED = [[1, 2], [3]]


def _tensors() -> dict[str, tuple[np.ndarray, QType]]:
    """Tensor name -> (what GGUFWriter stores, its type): float, half and Q8_0 data, odd shapes."""
    rng = np.random.default_rng(0)
    q8 = gguf.quants.quantize(rng.standard_normal((3, 64), dtype=np.float32), QType.Q8_0)
    return {
        "matrix": (rng.standard_normal((5, 7), dtype=np.float32), QType.F32),
        "vector": (rng.standard_normal(3).astype(np.float16), QType.F16),
        "quantized": (q8, QType.Q8_0),
        "cube": (np.arange(24, dtype=np.float32).reshape(2, 3, 4), QType.F32),
    }


def _write_small(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value, vtype) in SCALARS.items():
        writer.add_key_value(key, value, vtype)
    for key, (values, item_type) in ARRAYS.items():
        writer.add_key_value(key, values, GGUFValueType.ARRAY, item_type)
    writer.add_array("t.nested", NESTED)
    for name, (data, qtype) in _tensors().items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def small(tmp_path: Path) -> Path:
    return _write_small(tmp_path / "small.gguf")


def _reference_fields(reader: gguf.GGUFReader) -> dict:
    """GGUFReader's fields as values, minus the header entries it files under 'GGUF.'."""
    return {key: f.contents() for key, f in reader.fields.items() if not key.startswith("GGUF.")}


def _assert_same_tensors(got: list[GGUFTensor], reference: list[gguf.ReaderTensor]) -> None:
    assert [t.name for t in got] == [t.name for t in reference]
    for mine, theirs in zip(got, reference):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.shape == tuple(theirs.shape.tolist()), mine.name
        assert mine.data.dtype == np.uint8, mine.name
        expected = np.ascontiguousarray(theirs.data).reshape(-1).view(np.uint8)
        assert np.array_equal(mine.data, expected), mine.name


def test_default_model_matches_gguf_reader() -> None:
    path = default_gguf_path()
    got, reference = GGUFFile(path), gguf.GGUFReader(path)
    assert got.fields == _reference_fields(reference)
    assert len(got.fields["tokenizer.ggml.tokens"]) == 49152
    assert got.alignment == reference.alignment and got.data_offset == reference.data_offset
    _assert_same_tensors(got.tensors, reference.tensors)


def test_every_value_type_of_a_version_3_file(small: Path) -> None:
    got = GGUFFile(str(small))
    assert got.version == 3
    for key, (value, _) in {**SCALARS, **ARRAYS}.items():
        assert got.fields[key] == value and type(got.fields[key]) is type(value), key
    assert got.fields["t.nested"] == NESTED  # GGUFReader flattens nested arrays, so not compared
    reference = _reference_fields(gguf.GGUFReader(str(small)))
    assert {k: v for k, v in got.fields.items() if k != "t.nested"} == {
        k: v for k, v in reference.items() if k != "t.nested"
    }


def test_tensors_are_views_of_the_file(small: Path) -> None:
    got = GGUFFile(str(small))
    _assert_same_tensors(got.tensors, gguf.GGUFReader(str(small)).tensors)
    shapes = {t.name: t.shape for t in got.tensors}
    assert shapes == {"matrix": (7, 5), "vector": (3,), "quantized": (64, 3), "cube": (4, 3, 2)}
    assert all(t.data.base is not None and not t.data.flags.owndata for t in got.tensors)
    q8 = next(t for t in got.tensors if t.name == "quantized")
    assert q8.data.size == 3 * 2 * gguf.GGML_QUANT_SIZES[QType.Q8_0][1]
    assert got.data_offset % got.alignment == 0


def test_truncated_files_raise(small: Path, tmp_path: Path) -> None:
    data = small.read_bytes()
    # Inside the header, a key, the string array, the tensor infos, the tensor data.
    sizes = [0, 10, 23, 60, data.index("🙂".encode()) + 2, data.index(b"quantized") + 12, len(data) - 1]
    for size in sizes:
        truncated = tmp_path / f"truncated{size}.gguf"
        truncated.write_bytes(data[:size])
        with pytest.raises(GGUFFormatError, match="too short|file ends|needs bytes"):
            GGUFFile(str(truncated))


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        (lambda b: b"GGML" + b[4:], "bad magic"),
        (lambda b: b[:4] + (1).to_bytes(4, "little") + b[8:], "unsupported GGUF version 1$"),
        (lambda b: b[:4] + (3).to_bytes(4, "big") + b[8:], "big-endian"),
        (lambda b: b.replace("你好".encode(), b"\xff\xfe\xfd\xfc\xfb\xfa"), "not valid UTF-8"),
    ],
    ids=["magic", "version", "endianness", "utf8"],
)
def test_malformed_files_raise(small: Path, tmp_path: Path, patch, match: str) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(patch(small.read_bytes()))
    with pytest.raises(GGUFFormatError, match=match):
        GGUFFile(str(bad))
