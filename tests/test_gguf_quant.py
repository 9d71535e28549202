"""Tests for keeping GGUF weights quantized: ember.model.gguf_blocks.quantized and tensors(keep_quantized=True).

The mapping must add no loss beyond the file's own, so every check is exact equality with the
float decodings (gguf's reference and Ember's), never a tolerance. Each type's kept form is tested
on random blocks in test_gguf_types.py.
"""

import itertools

import gguf
import numpy as np
import pytest
import torch
from conftest import default_gguf_path
from gguf import GGMLQuantizationType as QType

from ember.bench.gguf_files import random_tensor
from ember.model.gguf import load_gguf
from ember.model.gguf_blocks import quantized
from ember.model.linear import QuantEmbedding, QuantLinear
from ember.quant import formats
from ember.quant.formats import QuantizedWeight


@pytest.mark.parametrize(("qtype", "shape"), [(QType.F32, (4, 32)), (QType.Q8_0, (128,))])
def test_quantized_rejects_float_types_and_vectors(qtype: QType, shape: tuple[int, ...]) -> None:
    raw = gguf.quants.quantize(np.ones(shape, dtype=np.float32), qtype)
    with pytest.raises(ValueError, match="no quantized form"):
        quantized(raw, qtype, shape)


def test_default_model_keeps_weights_quantized_exactly() -> None:
    """Only the embedding and layer 0 are compared: the generators decode lazily, so stopping
    early keeps the test fast while covering Q8_0, Q4_1, a permuted attn_q and float norms."""
    model = load_gguf(default_gguf_path())
    pairs = zip(model.tensors(keep_quantized=True), model.tensors())
    first = itertools.takewhile(lambda pair: not pair[1][0].startswith("model.layers.1."), pairs)
    kinds = {}
    for (name, kept), (float_name, dense) in first:
        assert name == float_name
        if isinstance(kept, QuantizedWeight):
            kinds[name] = kept.kind
            kept = formats.dequantize(kept).numpy()
        assert np.array_equal(kept.view(np.uint32), dense.view(np.uint32)), name
    assert kinds["model.embed_tokens.weight"] == "int8"
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "int4"
    assert "model.layers.0.input_layernorm.weight" not in kinds


def test_int5_widens_and_narrows_as_its_int8_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q5_0 kept as int5 runs: widened to int8, cut by rows or whole groups of columns (a tensor-parallel
    slice), it dequantizes to gguf's decoding; where the native kernels are off, layers keep it as int8."""
    raw = random_tensor(QType.Q5_0, (8, 128), np.random.default_rng(0))
    w = quantized(raw, QType.Q5_0, (8, 128))
    reference = torch.from_numpy(gguf.quants.dequantize(raw, QType.Q5_0))
    wide = formats.widen_int5(w)
    assert (w.kind, wide.kind, wide.qweight.dtype) == ("int5", "int8", torch.int8)
    for form in (w, wide):
        assert torch.equal(formats.dequantize(form), reference)
    assert torch.equal(formats.dequantize(w.narrow(0, 3, 4)), reference[3:7])
    assert torch.equal(formats.dequantize(w.narrow(1, 32, 64)), reference[:, 32:96])
    monkeypatch.setenv("EMBER_CPU_NATIVE", "0")
    assert QuantLinear([w], None, torch.float32).parts[0].kind == "int8"
    assert QuantEmbedding(w, torch.float32, tied=False).weight_q.kind == "int8"
