"""Every GGUF tensor type llama-quantize writes: exact decoding, the kept-quantized forms, the load log,
a mixed-type model that generates the same tokens kept quantized as decoded to float.

Equality is bitwise throughout (float32 bit patterns), against `gguf.quants.dequantize`, the
reference in the gguf package.
"""

from __future__ import annotations

import logging
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from ember import LLM, SamplingParams
from ember.bench.gguf_files import ALL_TYPES, ModelShape, random_tensor, write_model
from ember.model import gguf_blocks
from ember.model.gguf import load_gguf, quantized_tensor
from ember.model.gguf_blocks import QUANTIZED_TYPES, dequantize, quantized
from ember.quant import formats
from ember.quant.formats import QuantizedWeight

ROWS, BLOCKS_PER_ROW = 4, 8
# The kept form of every type with an exact one: kind, group size, symmetric, code range.
KEPT = {
    QType.Q8_0: ("int8", 32, True, (-128, 127)),
    QType.Q4_0: ("int4", 32, False, (0, 15)),
    QType.Q4_1: ("int4", 32, False, (0, 15)),
    QType.Q5_0: ("int5", 32, True, (-16, 15)),  # the file's blocks without their scales
    QType.Q5_1: ("int8", 32, False, (0, 31)),
    QType.Q2_K: ("int4", 16, False, (0, 3)),
    QType.Q3_K: ("int8", 16, True, (-4, 3)),
    QType.Q4_K: ("int4", 32, False, (0, 15)),
    QType.Q5_K: ("int8", 32, False, (0, 31)),
    QType.Q6_K: ("int8", 16, True, (-32, 31)),
    QType.IQ4_NL: ("int8", 32, True, (-127, 113)),
    QType.IQ4_XS: ("int8", 32, True, (-127, 113)),
    QType.TQ1_0: ("int8", 256, True, (-1, 1)),
    QType.TQ2_0: ("int8", 256, True, (-1, 2)),
    QType.MXFP4: ("int8", 32, True, (-12, 12)),
    QType.IQ2_XXS: ("int8", 32, True, (-43, 43)),
    QType.IQ2_XS: ("int8", 16, True, (-43, 43)),
    QType.IQ2_S: ("int8", 16, True, (-43, 43)),
    QType.IQ3_XXS: ("int8", 32, True, (-62, 62)),
    QType.IQ3_S: ("int8", 32, True, (-15, 15)),
    QType.IQ1_S: ("int8", 32, True, (-9, 9)),
    QType.IQ1_M: ("int8", 16, True, (-9, 9)),
}
# Q4_0 maps to q*d + (-8d), which yields +0.0 where llama.cpp's d*(q-8) yields -0.0: equal values.
SIGNED_ZERO_MAY_DIFFER = {QType.Q4_0}


def _can_quantize(qtype: QType) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, 256), dtype=np.float32), qtype)
    except NotImplementedError:
        return False
    return True


def _shape(qtype: QType) -> tuple[int, int]:
    return ROWS, BLOCKS_PER_ROW * max(32, gguf.GGML_QUANT_SIZES[qtype][0])


def _bits(x: np.ndarray | torch.Tensor, qtype: QType) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return (x + np.float32(0) if qtype in SIGNED_ZERO_MAY_DIFFER else x).view(np.uint32)


def _assert_decodes_exactly(raw: np.ndarray, qtype: QType) -> None:
    reference = gguf.quants.dequantize(raw, qtype)
    got = dequantize(raw, qtype, _shape(qtype))
    assert got.dtype == np.float32 and got.shape == reference.shape == _shape(qtype)
    assert np.array_equal(_bits(got, qtype), _bits(reference, qtype))
    if qtype in QUANTIZED_TYPES:
        kept = formats.dequantize(quantized(raw, qtype, _shape(qtype))).numpy()
        assert np.array_equal(_bits(kept, qtype), _bits(reference, qtype))


def test_every_type_llama_quantize_writes_is_supported() -> None:
    assert len(ALL_TYPES) == 25 and set(ALL_TYPES) <= gguf_blocks.SUPPORTED_TYPES
    assert set(KEPT) == QUANTIZED_TYPES == set(ALL_TYPES) - {QType.F32, QType.F16, QType.BF16}


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_random_blocks_decode_exactly(qtype: QType, monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks of 2 blocks (1 of 256 elements) put chunk boundaries inside rows, where codes and scales could slip.
    monkeypatch.setattr(gguf_blocks, "_ELEMENTS_PER_CHUNK", 64)
    with np.errstate(all="ignore"):  # random IQ1_M scales may be inf: the reference decodes them too
        _assert_decodes_exactly(random_tensor(qtype, _shape(qtype), np.random.default_rng(int(qtype))), qtype)


@pytest.mark.parametrize("qtype", [t for t in ALL_TYPES if _can_quantize(t)], ids=lambda t: t.name)
def test_quantized_float_tensor_round_trips(qtype: QType) -> None:
    values = np.random.default_rng(int(qtype)).standard_normal(_shape(qtype), dtype=np.float32)
    raw = gguf.quants.quantize(values, qtype)
    _assert_decodes_exactly(raw, qtype)
    if qtype == QType.F32:
        assert np.array_equal(dequantize(raw, qtype, _shape(qtype)), values)


@pytest.mark.parametrize("qtype", list(KEPT), ids=lambda t: t.name)
def test_kept_form_and_memory(qtype: QType) -> None:
    kind, group_size, symmetric, (lo, hi) = KEPT[qtype]
    rows, cols = _shape(qtype)
    w = quantized(random_tensor(qtype, (rows, cols), np.random.default_rng(0)), qtype, (rows, cols))
    assert (w.kind, w.group_size, w.zeros is None) == (kind, group_size, symmetric)
    assert (w.out_features, w.in_features, w.num_groups) == (rows, cols, cols // group_size)
    codes = formats.codes(w)
    assert lo <= int(codes.min()) and int(codes.max()) <= hi
    code_bytes = rows * cols * {"int8": 8, "int5": 5, "int4": 4}[kind] // 8
    scale_bytes = 2 if w.runs else 4  # Q4_1 keeps its float16 d and m (gguf_blocks._RUNS_TYPES)
    assert w.nbytes() == code_bytes + rows * (cols // group_size) * scale_bytes * (1 if symmetric else 2)


def test_q4_1_runs_repack_exactly() -> None:
    """Q4_1 comes in the file's runs (float16 d and m); `packed`, which every consumer but the native
    kernels gets, is Ember's int4 packing of the same values, and both dequantize to gguf's reference."""
    rows, cols = _shape(QType.Q4_1)
    raw = random_tensor(QType.Q4_1, (rows, cols), np.random.default_rng(1))
    w = quantized(raw, QType.Q4_1, (rows, cols))
    p = formats.packed(w)
    assert w.runs and not p.runs and p.scales.dtype == torch.float32
    assert torch.equal(formats.codes(p), formats.codes(w))
    assert torch.equal(p.qweight, formats.pack_int4(formats.codes(w)))
    reference = torch.from_numpy(gguf.quants.dequantize(raw, QType.Q4_1).reshape(rows, cols))
    assert torch.equal(formats.dequantize(w), reference) and torch.equal(formats.dequantize(p), reference)


# --- a model mixing the new types ---------------------------------------------------------------

SHAPE = ModelShape(hidden=256, layers=2, ffn=512, heads=4, kv_heads=2, vocab=320, arch="llama")
MIX = {
    "token_embd": QType.Q5_1,
    "blk.0.attn_q": QType.Q3_K,
    "blk.0.attn_k": QType.IQ4_NL,
    "blk.0.attn_v": QType.Q5_0,
    "blk.0.attn_output": QType.IQ4_XS,
    "blk.0.ffn_gate": QType.Q2_K,
    "blk.0.ffn_up": QType.TQ2_0,
    "blk.0.ffn_down": QType.IQ2_XXS,
    "blk.1.attn_q": QType.MXFP4,
    "blk.1.attn_k": QType.TQ1_0,
    "blk.1.attn_v": QType.BF16,
    "blk.1.attn_output": QType.IQ3_S,
    "blk.1.ffn_gate": QType.F16,
    "blk.1.ffn_up": QType.Q6_K,
    "blk.1.ffn_down": QType.Q5_K,
}


def _mixed_type(name: str, shape: tuple[int, ...], layers: int) -> QType:
    return QType.F32 if len(shape) == 1 else MIX[name.removesuffix(".weight")]


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("gguf_types") / "mixed.gguf")
    write_model(path, SHAPE, _mixed_type)
    return path


def test_mixed_model_tensors_kept_equal_decoded(mixed_model: str, caplog: pytest.LogCaptureFixture) -> None:
    model = load_gguf(mixed_model)
    with caplog.at_level(logging.INFO, logger="ember"):
        kept = dict(model.tensors(keep_quantized=True))
    dense = dict(model.tensors())
    assert kept.keys() == dense.keys()
    for name, weight in kept.items():
        if isinstance(weight, QuantizedWeight):
            weight = formats.dequantize(weight).numpy()
        assert np.array_equal(weight.view(np.uint32), dense[name].view(np.uint32)), name
    assert kept["model.layers.0.mlp.down_proj.weight"].kind == "int8"  # IQ2_XXS
    assert kept["model.layers.0.mlp.gate_proj.weight"].kind == "int4"  # Q2_K
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("mixed.gguf: "))
    for part in (
        "BF16 x 1 -> float",
        "F32 x 5 -> float",
        "IQ2_XXS x 1 -> int8 g32 (kept)",
        "Q2_K x 1 -> int4 g16 (kept)",
        "Q5_1 x 1 -> int8 g32 (kept)",
        "TQ1_0 x 1 -> int8 g256 (kept)",
    ):
        assert part in line


def test_mixed_model_generates_the_float_decodings_tokens(mixed_model: str) -> None:
    """Kept-quantized layers run Ember's quantized CPU paths; with float32 activations and no
    tinygemm-packed (bf16-activation) type in the mix, they must pick the same greedy tokens."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [5 + (i * 37) % 300 for i in range(n)]} for n in (3, 20)]
    outs = {}
    for mode in ("gguf", "none"):
        llm = LLM(
            mixed_model,
            quantization=mode,
            dtype="float32",
            kv_cache_memory=0.01,
            max_model_len=128,
            engine_process=False,
        )
        outs[mode] = llm.generate(prompts, params, use_tqdm=False)
    for kept, dense in zip(outs["gguf"], outs["none"]):
        assert kept.outputs[0].token_ids == dense.outputs[0].token_ids
        assert len(set(kept.outputs[0].token_ids)) > 1  # the model is not degenerate


# Qwen2-0.5B's Q4_K_M mix in miniature: rows of 160 are no multiple of 256, so as in the real file most
# matrices are Q5_0, the embedding and the wide attn_v Q8_0, ffn_down (rows of 256) Q6_K or Q4_K.
QWEN2_MINI = ModelShape(hidden=160, layers=3, ffn=256, heads=5, kv_heads=1, vocab=320)


def test_q4_k_m_qwen2_generates_the_float_decodings_tokens(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept quantized through the native CPU kernels (Q5_0 in 5 bits, K-quants' two-level scales, every
    layers in one decode_layers call)
    against the float32 decoding: the same greedy tokens. Q4_K in float32 here (CPU_INT4_BF16 off): bf16
    arithmetic may part from float32 on near ties."""
    from ember.cpu_native import ops as native
    from ember.ops import linear_native

    path = str(tmp_path / "qwen2-q4_k_m.gguf")
    types = write_model(path, QWEN2_MINI)
    assert {types["blk.0.attn_q.weight"], types["blk.0.attn_v.weight"], types["token_embd.weight"]} == {
        QType.Q5_0,
        QType.Q8_0,
    }
    assert {types[f"blk.{i}.ffn_down.weight"] for i in range(3)} == {QType.Q6_K, QType.Q4_K}
    monkeypatch.setattr(linear_native, "CPU_INT4_BF16", False)
    layer_kinds: set[tuple[str, int]] = set()
    record = native.layer_record

    def spy(w: native.DecodeLayerWeights, *args: Any) -> list[int]:
        layer_kinds.update((nat.kind, nat.param_mode) for nat in (w.qkv, w.o, w.gate_up, w.down))
        return record(w, *args)

    monkeypatch.setattr(native, "layer_record", spy)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + (i * 37) % 300 for i in range(n)]} for n in (3, 20)]
    outs = {}
    for mode in ("gguf", "none"):
        llm = LLM(
            path,
            quantization=mode,
            device="cpu",  # the native CPU kernels' test, on a GPU machine too
            dtype="float32",
            kv_cache_memory=0.01,
            max_model_len=128,
            engine_process=False,
        )
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["gguf"] == outs["none"]
    assert all(len(set(tokens)) > 1 for tokens in outs["gguf"])  # the model is not degenerate
    if native.available():
        # Q5_0 in 5 bits, Q8_0 int8, both with float16 scales; Q6_K and Q4_K with two-level scales
        assert layer_kinds == {("int5", 1), ("int8", 1), ("int8", 2), ("int4", 2)}


def test_q4_1_experts_take_embers_packing() -> None:
    """Stacked Q4_1 experts (the expert kernels read Ember's int4 packing, not the file's runs): each
    expert decodes to gguf's reference."""
    rows, cols = _shape(QType.Q4_1)
    raw = random_tensor(QType.Q4_1, (2 * rows, cols), np.random.default_rng(2))
    experts = quantized_tensor(raw, QType.Q4_1, (2, rows, cols))
    reference = torch.from_numpy(gguf.quants.dequantize(raw, QType.Q4_1).reshape(2, rows, cols))
    for e in range(2):
        assert torch.equal(formats.dequantize(experts.expert(e)), reference[e])
