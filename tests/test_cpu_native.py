"""The native CPU kernels (ember/cpu_native) against float64 references, both the AVX-512 build and
the plain-C one (-mno-avx512f); their build cache and fallback; and the default model and a tiny
quantized Llama end to end through them."""

from __future__ import annotations

import logging
import math
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import default_gguf_path, inproc_core, make_checkpoint
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file, save_file

from ember import LLM, SamplingParams
from ember.bench.gguf_files import random_tensor
from ember.cpu_native import build, ops
from ember.model.gguf_blocks import quantized
from ember.model.linear import QuantEmbedding, QuantLinear
from ember.ops import linear_native as linear
from ember.ops.linear_native import NATIVE_EXPAND_MIN_ROWS, row_bucket
from ember.quant.formats import QuantizedWeight, codes, concat_out, dense_weight, dequantize, pack_int4, widen_int5
from ember.quant.quantize import quantize


def _has_compiler() -> bool:
    try:
        return bool(build.compiler())
    except build.BuildError:
        return False


# Only a missing compiler skips: kernels that fail to build fail every test below.
pytestmark = pytest.mark.skipif(not _has_compiler(), reason="no C compiler: the PyTorch paths are tested elsewhere")


@pytest.fixture(autouse=True)
def native_on(monkeypatch):
    """The kernels in use even on CPUs without AVX-512 (where, unset, EMBER_CPU_NATIVE leaves them off)."""
    monkeypatch.setenv("EMBER_CPU_NATIVE", "1")


@pytest.fixture(scope="module")
def plain_c():
    """The kernels built without AVX-512: their #else code."""
    module = build.load(build.build(("-mno-avx512f",)))
    assert module.simd() == "scalar"
    return module


@pytest.fixture(params=["native", "plain-c"])
def kernels(request, monkeypatch):
    """The kernels ops.py calls, for one test: the -march=native build or the plain-C one."""
    if request.param == "plain-c":
        module = request.getfixturevalue("plain_c")
        monkeypatch.setattr(ops, "kernels", lambda: module)
    return ops.kernels()


def _weight(kind: str, n: int, k: int, group: int, zeros: bool, seed: int = 0, half: bool = False) -> QuantizedWeight:
    """Random codes, scales and zeros (a whole number of groups); `half`: scales and zeros that float16
    holds exactly, as GGUF Q4_0/Q4_1 store them."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "int4":
        qweight = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
    elif kind == "int5":  # int8 codes in [-16, 15], GGUF Q5_0's, which the kernels keep in 5 bits
        qweight, kind = torch.randint(-16, 16, (n, k), generator=gen, dtype=torch.int8), "int8"
    else:
        qweight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    zero = torch.randn(n, k // group, generator=gen) * 0.1 if zeros else None
    if half:
        scales, zero = scales.half().float(), None if zero is None else zero.half().float()
    return QuantizedWeight(kind, qweight, scales, zero, group, k)


def _check_matmul(x: torch.Tensor, w: QuantizedWeight) -> None:
    dense = dequantize(w).double()
    got = ops.matmul(x, ops.native_weight(w)).double()
    ref = x.double() @ dense.T
    # float32 summation error, bounded by the sum of the terms' magnitudes
    bound = 2e-6 * math.sqrt(w.in_features) * (x.double().abs() @ dense.abs().T) + 1e-7
    assert (got - ref).abs().le(bound).all(), (got - ref).abs().max()


@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize(
    ("kind", "group"),
    [("int4", 32), ("int4", 64), ("int4", 128), ("int8", 16), ("int8", 32), ("int8", None), ("int5", 32), ("int5", 64)],
)
def test_gemv_matches_float64_reference(kernels, kind: str, group: int | None, zeros: bool) -> None:
    """M covers one row (the 4-row block), the 8-row tile and every remainder tile; N = 70 and 33
    leave 2 and 1 rows past the blocks of 4; K holds several groups. group None: per-channel int8.
    The second weight's scales and zeros are float16 values, which the kernels keep as float16. int5:
    int8 codes in [-16, 15] without zeros are packed to 5 bits; with zeros they stay int8."""
    for (n, k), seed in zip([(70, 384), (33, 256)], range(2)):
        w = _weight(kind, n, k, group or k, zeros, seed, half=seed == 1)
        native = ops.native_weight(w)
        assert (native.scales.dtype == torch.float16) == (seed == 1)
        assert native.kind == ("int5" if kind == "int5" and not zeros else w.kind)
        for m in (1, 3, 8, 13, 17):
            _check_matmul(torch.randn(m, k, generator=torch.Generator().manual_seed(m)), w)


@pytest.mark.parametrize(("kind", "k", "group"), [("int4", 320, 128), ("int4", 64, 128), ("int8", 80, 32)])
def test_gemv_and_expansion_with_a_shorter_last_group(kernels, kind: str, k: int, group: int) -> None:
    """`quantize_int4` gives a K that is not a multiple of its group a shorter last group."""
    w = _weight(kind, 21, k, group, True)
    w = QuantizedWeight(
        kind, w.qweight, torch.rand(21, -(-k // group)) * 0.1, torch.randn(21, -(-k // group)) * 0.1, group, k
    )
    for m in (1, 5, 9):
        _check_matmul(torch.randn(m, k), w)
    assert torch.equal(ops.dequantize(ops.native_weight(w)), dequantize(w))


@pytest.mark.parametrize(("kind", "group"), [("int4", 32), ("int4", 128), ("int8", 16), ("int8", 96), ("int5", 32)])
@pytest.mark.parametrize("zeros", [True, False])
def test_expansion_equals_dequantize(kernels, kind: str, group: int, zeros: bool) -> None:
    w = _weight(kind, 37, 384 if group != 96 else 96, group, zeros, half=group == 32)
    dense = ops.dequantize(ops.native_weight(w))
    assert dense.dtype == torch.float32 and torch.equal(dense, dequantize(w))


def test_int5_packing_takes_only_five_bit_codes(kernels) -> None:
    """Q5_0's codes (-16 and 15 included) pack to 20 bytes a run of 32; one code outside keeps int8; K not
    a multiple of 32 keeps int8."""
    w = _weight("int5", 5, 64, 32, False, half=True)
    w.qweight[0, :2] = torch.tensor([-16, 15], dtype=torch.int8)
    native = ops.native_weight(w)
    assert native.kind == "int5" and native.codes.shape == (5, 40)
    assert torch.equal(ops.dequantize(native), dequantize(w))
    w.qweight[4, 63] = 16
    assert ops.native_weight(w).kind == "int8"
    assert ops.native_weight(_weight("int5", 5, 48, 16, False)).kind == "int8"


def test_float16_parameters_convert_exactly(kernels) -> None:
    """float16 scales and zeros at the edges of the format: subnormals, signs, the largest value."""
    values = torch.tensor([2.0**-24, 3 * 2.0**-20, 1e-5, -0.5, 65504.0, -(2.0**-14), 0.0, 1.0]).half().float()
    w = _weight("int4", 8, 256, 32, True)
    w = QuantizedWeight("int4", w.qweight, values.repeat(8, 1), -values.flip(0).repeat(8, 1), 32, 256)
    native = ops.native_weight(w)
    assert native.scales.dtype == torch.float16
    assert torch.equal(ops.dequantize(native), dequantize(w))


def test_fits_and_clear_errors() -> None:
    assert not ops.fits(_weight("int4", 8, 64, 16, True))  # int4 groups must be runs of 32
    assert not ops.fits(QuantizedWeight("int8", torch.zeros(8, 40, dtype=torch.int8), torch.ones(8, 1), None, 40, 40))
    w = _weight("int4", 8, 64, 32, True)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        ops.matmul(torch.randn(2, 32), ops.native_weight(w))
    with pytest.raises(ValueError, match="x must be a CPU torch.float32"):
        ops.matmul(torch.randn(2, 64, dtype=torch.float64), ops.native_weight(w))
    with pytest.raises(ValueError, match="does not fit"):
        ops.native_weight(_weight("int4", 8, 64, 16, True))


@pytest.mark.parametrize("bf16", [False, True])
def test_kernels_refuse_int4_groups_of_16(kernels, bf16: bool) -> None:
    """int4 groups of 16 (GGUF Q2_K's) are refused by fits(), so such weights take PyTorch's path. Passed
    to the kernels anyway, the AVX-512 tiles read 32 codes and inputs a group, past x's last row: outputs
    of 1e14 and more that changed from call to call. The kernels refuse the layout themselves; a weight
    that fits at the same K (groups of 32, 928 = 29 runs) gives the reference, call after call."""
    if bf16 and not ops.has_bf16():
        pytest.skip("no AVX512_BF16")
    w = _weight("int4", 152, 928, 16, True, half=True)
    assert not ops.fits(w)
    scales, zeros = ops._compact_params(w.scales, w.zeros)
    unfit = ops.NativeWeight("int4", ops._relayout_int4(w.qweight, 928), scales, zeros, 16, 928, bf16)
    x = torch.randn(5, 928, generator=torch.Generator().manual_seed(5))
    for _ in range(20):  # on main the AVX-512 build returned different garbage each call; plain C no error
        for call in (lambda: ops.matmul(x, unfit), lambda: ops.matmul_silu(x, unfit), lambda: ops.dequantize(unfit)):
            with pytest.raises(ValueError, match="does not fit the kernels"):
                call()
    fit = _weight("int4", 151, 928, 32, True)
    native, first = ops.native_weight(fit), None
    for _ in range(20):
        got = ops.matmul(x, native)
        assert first is None or torch.equal(got, first)
        first = got
    _check_matmul(x, fit)


def _reference_attention(q, k_cache, v_cache, tables, lens, scale, window, cap, sinks) -> torch.Tensor:
    """Straight from `paged_attention`'s definition, in float64, one query at a time."""
    nd, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(nd, hq, d, dtype=torch.float64)
    for i in range(nd):
        n = int(lens[i])
        pos = torch.arange(n)
        slots = tables[i, pos // bs].long() * bs + pos % bs
        k = k_cache.flatten(0, 1)[slots].double()  # [n, Hk, D]
        v = v_cache.flatten(0, 1)[slots].double()
        visible = pos > n - 1 - window if window else torch.ones(n, dtype=torch.bool)
        for h in range(hq):
            s = k[:, h // (hq // hk)] @ q[i, h].double() * scale
            if cap:
                s = cap * torch.tanh(s / cap)
            s = s.masked_fill(~visible, float("-inf"))
            if sinks is not None:
                s = torch.cat([s, sinks[h : h + 1].double()])
            p = torch.softmax(s, 0)[:n]
            out[i, h] = p @ v[:, h // (hq // hk)]
    return out


@pytest.mark.parametrize(
    ("window", "cap", "with_sinks", "d"),
    [(None, None, False, 32), (5, None, False, 32), (None, 3.0, False, 24), (7, 2.0, True, 24), (None, None, True, 64)],
)
def test_paged_decode_attention_matches_float64_reference(kernels, window, cap, with_sinks, d) -> None:
    """GQA (6 query heads on 2 KV heads), ragged lengths over several blocks of 4 keys, shuffled block
    tables with a row stride past their width, queries read through a strided view."""
    gen = torch.Generator().manual_seed(d)
    hq, hk, bs, lens = 6, 2, 4, [1, 9, 23, 16]
    k_cache = torch.randn(40, bs, hk, d, generator=gen)
    v_cache = torch.randn(40, bs, hk, d, generator=gen)
    tables = torch.randperm(40, generator=gen)[:32].to(torch.int32).view(4, 8)[:, :6]  # row stride 8
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(4, hq + hk, d, generator=gen)[:, :hq] * 2
    sinks = torch.randn(hq, generator=gen) if with_sinks else None
    scale = d**-0.5
    got = ops.paged_decode_attention(
        q, k_cache, v_cache, tables, seq_lens, scale, window=window, soft_cap=cap, sinks=sinks
    )
    ref = _reference_attention(q, k_cache, v_cache, tables, seq_lens, scale, window, cap, sinks)
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=1e-5)


def test_attention_checks_its_inputs() -> None:
    q, cache = torch.randn(1, 4, 16), torch.randn(2, 4, 2, 16)
    tables, lens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_tables must be a CPU torch.int32"):
        ops.paged_decode_attention(q, cache, cache, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="head dims must match"):
        ops.paged_decode_attention(torch.randn(1, 4, 8), cache, cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match=r"sinks must have shape \(4,\)"):
        ops.paged_decode_attention(q, cache, cache, tables, lens, 1.0, sinks=torch.zeros(3))


@pytest.mark.parametrize("shape", [(1, 49152), (16, 4099), (3, 17), (2, 5), (1, 1)])
def test_argmax_picks_torchs_index(kernels, shape: tuple[int, int]) -> None:
    """The first largest value's index, a NaN's where a row has one, on random rows, ties, -inf and
    signed zeros, and strided rows; in the vector loop and in the tail past it."""
    gen = torch.Generator().manual_seed(0)
    ties = torch.randint(-3, 3, shape, generator=gen).float()
    nans = torch.randn(shape, generator=gen)
    nans[0, -1] = nans[-1, shape[1] // 2] = nans[-1, 0] = float("nan")
    zeros = torch.zeros(shape)
    zeros[:, -1] = -0.0
    strided = torch.randn(shape[0], shape[1] + 3, generator=gen)[:, 3:]
    rows = [torch.randn(shape, generator=gen), ties, nans, torch.full(shape, float("-inf")), zeros, strided]
    for x in rows:
        assert ops.argmax_fits(x)
        assert torch.equal(ops.argmax(x), x.argmax(dim=-1))
    assert not ops.argmax_fits(torch.randn(4, 6).t()) and not ops.argmax_fits(torch.randn(2, 3).double())


def test_native_layouts_do_not_grow_memory() -> None:
    """The int4 layout replaces the codes it came from; a tied int8 head shares the embedding's codes
    and scales and keeps neither a dense copy nor a bf16 screen."""
    w4 = _weight("int4", 64, 128, 32, True)
    layer = QuantLinear([w4], None, torch.float32)
    assert sum(t.numel() * t.element_size() for t in layer.weight_tensors()) == w4.nbytes()
    w4 = _weight("int4", 64, 128, 32, True, half=True)  # float16 scales and zeros: half their bytes
    layer = QuantLinear([w4], None, torch.float32)
    assert sum(t.numel() * t.element_size() for t in layer.weight_tensors()) == w4.nbytes() - 64 * 4 * 2 * 2
    w8 = _weight("int8", 96, 64, 32, False)
    emb = QuantEmbedding(w8, torch.float32, tied=True)
    assert emb.screen is None
    assert sum(t.numel() * t.element_size() for t in {id(t): t for t in emb.weight_tensors()}.values()) == w8.nbytes()
    x = torch.randn(3, 64)
    xa = x.bfloat16().float() if ops.bf16_fits(w8) else x  # int8 in bf16 arithmetic rounds x alone
    torch.testing.assert_close(emb.attend(x), xa @ dequantize(w8).T, rtol=1e-5, atol=1e-4)
    assert torch.equal(emb.argmax(x), emb.attend(x).argmax(dim=1))


def _bf16_weight(w: QuantizedWeight) -> torch.Tensor:
    """The weight bf16 arithmetic multiplies: q * scale + zero rounded once to float32 (an FMA), then to bf16."""
    group = torch.arange(w.in_features) // w.group_size
    dense = codes(w).double() * w.scales.double()[:, group]
    if w.zeros is not None:
        dense = dense + w.zeros.double()[:, group]
    return dense.float().bfloat16()


def _bf16_reference(x: torch.Tensor, w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 arithmetic in float64: x and w rounded to bf16, exact sums (before the output's rounding), and
    the sums' float32 error bound."""
    xb, wb = x.bfloat16().double(), _bf16_weight(w).double()
    return xb @ wb.T, 2e-6 * math.sqrt(w.in_features) * (xb.abs() @ wb.abs().T) + 1e-7


def _within_output_rounding(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> bool:
    """got is ref, give or take the float32 sums' error, rounded to bf16 (half an ulp, 2^-9 relative)."""
    assert torch.equal(got, got.bfloat16().float())  # every output rounded to bf16
    return bool(((got.double() - ref).abs() <= bound + ref.abs() * 2.0**-8).all())


@pytest.mark.skipif(not ops.has_bf16(), reason="this CPU has no AVX512_BF16: int4 is float32 at every row count")
@pytest.mark.parametrize("half", [False, True])
def test_bf16_gemv_matches_bf16_reference(half: bool) -> None:
    """int4 in bf16 arithmetic: x and the dequantized weights rounded to bf16, float32 sums, outputs
    rounded to bf16; the gate/up + SiLU variant applies silu to those outputs; the expansion is
    `dequantize(w)` rounded to bf16."""
    w = _weight("int4", 70, 384, 64, True, half=half)
    nat = ops.native_weight(w, bf16=True)
    for m in (1, 3, 16, 17, 27):
        x = torch.randn(m, 384)
        got = ops.matmul(x, nat)
        assert _within_output_rounding(got, *_bf16_reference(x, w))
        gate, up = got.split(35, dim=-1)
        torch.testing.assert_close(ops.matmul_silu(x, nat), F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    assert torch.equal(ops.dequantize(nat), _bf16_weight(w))


def _int58_bf16_reference(x: torch.Tensor, w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """int5/int8 bf16 arithmetic in float64: x rounded to bf16 times the exact weights (codes times scales),
    exact sums, and the float32 sums' error bound."""
    xb, dense = x.bfloat16().double(), dequantize(w).double()
    return xb @ dense.T, 2e-6 * math.sqrt(w.in_features) * (xb.abs() @ dense.abs().T) + 1e-7


@pytest.mark.skipif(not ops.has_bf16(), reason="this CPU has no AVX512_BF16: int5/int8 are float32")
@pytest.mark.parametrize(
    ("kind", "k", "group", "half"),
    [
        ("int5", 96, 32, True),
        ("int5", 128, 64, False),
        ("int8", 96, 32, True),
        ("int8", 128, 16, False),
        ("int8", 160, None, False),
    ],
)
def test_int5_int8_bf16_gemv_matches_float64_reference(kind: str, k: int, group: int | None, half: bool) -> None:
    """int5 and zero-free int8 in bf16 arithmetic: x rounded to bf16, the codes exact, each group's float32
    sum times its scale, so the float64 product of bf16(x) and the dequantized weight within the float32
    sums' error (and not x's own product: x was rounded); each row alone as in its batch; the GEMV + SiLU
    and gemv_lora the GEMV's numbers; the expansion float32, exact. K 96 and 160: a run of 32 after the
    blocks of 64; groups of 16 (Q6_K), 32, 64 and per channel."""
    w = _weight(kind, 38, k, group or k, False, half=half)
    nat = ops.native_weight(w, bf16=True)
    assert nat.kind == kind and nat.bf16
    x = torch.randn(17, k)
    got = ops.matmul(x, nat)
    ref, bound = _int58_bf16_reference(x, w)
    assert (got.double() - ref).abs().le(bound).all()
    assert not (got.double() - x.double() @ dequantize(w).double().T).abs().le(bound).all()
    for m in (1, 2, 3, 9):
        assert torch.equal(ops.matmul(x[:m], nat), got[:m]), m
    gate, up = got.split(19, dim=-1)
    torch.testing.assert_close(ops.matmul_silu(x, nat), F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    no_adapter = torch.full((17,), -1, dtype=torch.int32)
    assert torch.equal(ops.matmul_lora(x, nat, None, (torch.zeros(1, 4, k), [torch.zeros(1, 4, 38)]), no_adapter), got)
    assert torch.equal(ops.dequantize(nat), dequantize(w))


def test_plain_c_build_refuses_bf16_arithmetic(plain_c) -> None:
    """Without AVX512_BF16 (the plain-C build) the bf16 variants raise; ops.bf16_fits keeps them unused."""
    for name in ("gemv_q4_bf16", "gemv_q5_bf16", "gemv_q8_bf16"):
        with pytest.raises(RuntimeError, match="built without AVX512_BF16"):
            getattr(plain_c, name)(0, 0, 0, 0, 0, 1, 32, 1, 32, 1, 0)


@pytest.mark.parametrize("kind", ["int4", "int5", "int8"])
@pytest.mark.parametrize("bf16", [False, True])
def test_gemv_over_windows_of_rows_gives_each_row_its_own_sums(kind: str, bf16: bool) -> None:
    """At K 4096 a window of activation rows (gemv.c, WINDOW_BYTES) holds 16 bf16 or 8 float32 rows: 43 rows
    take several windows and a last short one, alone and inside gemv_lora's region (a bias and one row
    under an adapter), every row's outputs bit for bit those of the row alone."""
    if bf16 and not ops.has_bf16():
        pytest.skip("this CPU has no AVX512_BF16")
    w = _weight(kind, 10, 4096, 32, kind == "int4")
    nat = ops.native_weight(w, bf16=bf16)
    x = torch.randn(43, 4096)
    alone = torch.cat([ops.matmul(row[None], nat) for row in x])
    assert torch.equal(ops.matmul(x, nat), alone)
    bias, slots = torch.randn(10), torch.full((43,), -1, dtype=torch.int32)
    slots[7] = 0
    lora = (torch.randn(1, 4, 4096) * 0.01, [torch.randn(1, 4, 10)])
    fused = ops.matmul_lora(x, nat, bias, lora, slots)
    rows = [ops.matmul_lora(x[m : m + 1], nat, bias, lora, slots[m : m + 1]) for m in range(43)]
    assert torch.equal(fused, torch.cat(rows))
    assert torch.equal(fused[:7], alone[:7] + bias) and not torch.equal(fused[7], alone[7] + bias)


@pytest.mark.parametrize("arithmetic", ["int4-bf16", "int4-float32", "int8-float32", "int5-bf16", "int8-bf16"])
def test_quant_linear_keeps_one_arithmetic_at_every_row_count(monkeypatch, arithmetic: str) -> None:
    """Below the crossover the native GEMV runs, from it the weight is expanded for oneDNN's GEMM: either
    way the weight's one arithmetic (bf16 for int4, int5 and zero-free int8 where the CPU has it, float32
    otherwise; int5 and int8 in bf16 never expand). Below the
    crossover each row's result is bit for bit the same whatever the batch it comes in; past it, the
    same up to summation order. So a prompt's tail computed after a prefix-cache hit sees the numbers
    the whole prompt would."""
    kind, dtype = arithmetic.split("-")
    if dtype == "bf16" and not ops.has_bf16():
        pytest.skip("this CPU has no AVX512_BF16")
    monkeypatch.setattr(linear, "CPU_INT4_BF16", dtype == "bf16")
    monkeypatch.setattr(linear, "CPU_INT8_BF16", dtype == "bf16")
    codes_only = kind != "int4" and dtype == "bf16"  # int5/int8 bf16 arithmetic: weights without zeros
    w = _weight(kind, 48, 96, 32, not codes_only)
    layer = QuantLinear([w], None, torch.float32)
    assert layer._native[0].bf16 == (dtype == "bf16")
    crossover = linear.native_expand_min_rows(layer._native[0])
    assert crossover == (math.inf if codes_only else NATIVE_EXPAND_MIN_ROWS[dtype])
    top = int(min(crossover, NATIVE_EXPAND_MIN_ROWS["float32"]))
    x = torch.randn(top + 3, 96)
    alone = torch.cat([layer(row[None]) for row in x])
    for rows in (1, 5, 16, top - 1, top, top + 3):
        got = layer(x[:rows]).double()
        if codes_only:
            ref, bound = _int58_bf16_reference(x[:rows], w)
        elif dtype == "bf16":
            ref, bound = _bf16_reference(x[:rows], w)
            bound = bound + ref.abs() * 2.0**-8  # the sums' error, then the output's rounding
        else:
            dense = dequantize(w).double()
            ref, bound = x[:rows].double() @ dense.T, 1e-6 * math.sqrt(96) * (x[:rows].double().abs() @ dense.abs().T)
        assert (got - ref).abs().le(bound + 1e-7).all(), rows
        if rows < crossover:
            assert torch.equal(got, alone[:rows].double()), rows
        else:  # oneDNN sums in its own order: apart by the sums' error (and, in bf16, a rounding)
            assert (got - alone[:rows]).abs().le(2 * bound + 1e-7).all(), rows


def test_expanded_gemm_sees_few_row_counts_and_padding_changes_no_row(monkeypatch) -> None:
    """oneDNN keeps state per row count, so the expanded GEMM runs on rows padded to a few bucket sizes
    (a server's steps have every count from the crossover to thousands); the padding rows are zeros and
    change none of the real rows' results."""
    buckets = {row_bucket(m) for m in range(NATIVE_EXPAND_MIN_ROWS["bf16"], 8193)}
    assert len(buckets) <= 40
    assert all(m <= row_bucket(m) <= 1.25 * m for m in range(1, 8193))
    monkeypatch.setattr(linear, "CPU_INT4_BF16", ops.has_bf16())
    w = _weight("int4", 48, 96, 32, True)
    layer = QuantLinear([w], None, torch.float32)
    dense = ops.dequantize(layer._native[0])
    for rows in (NATIVE_EXPAND_MIN_ROWS["float32"] + 1, 33, 100):
        if rows < linear.native_expand_min_rows(layer._native[0]):
            continue
        x = torch.randn(rows, 96)
        assert row_bucket(rows) > rows  # these are padded
        unpadded = F.linear(x.to(dense.dtype), dense).to(torch.float32)
        assert torch.equal(layer(x), unpadded), rows


def test_one_openmp_runtime_after_a_native_call() -> None:
    """The kernels must join torch's libgomp, not load a second runtime (its threads would spin
    against torch's on the same cores)."""
    ops.matmul(torch.randn(2, 64), ops.native_weight(_weight("int4", 64, 64, 32, True)))
    torch.randn(256, 256) @ torch.randn(256, 256)
    maps = Path("/proc/self/maps").read_text().splitlines()
    gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) == 1, gomp


def test_cache_key_follows_the_source(tmp_path, monkeypatch) -> None:
    cc = build.compiler()
    before = build.library_path(cc)
    sources = tmp_path / "csrc"
    shutil.copytree(build.SOURCES, sources)
    (sources / "gemv.c").write_text((sources / "gemv.c").read_text() + "\n/* changed */\n")  # any family's file
    monkeypatch.setattr(build, "SOURCES", sources)
    assert build.library_path(cc) != before
    assert build.library_path(cc, ("-mno-avx512f",)) != build.library_path(cc)


def test_broken_compiler_falls_back_with_one_warning(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.WARNING, logger="ember"):
        assert ops.load_kernels() is None
    assert len([r for r in caplog.records if "CPU native kernels unavailable" in r.getMessage()]) == 1
    done = subprocess.run(
        [sys.executable, "-m", "ember.cpu_native.build"], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "were not built" in done.stderr
    assert not list(tmp_path.rglob("*.so"))


def _generate(llm: LLM, prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs]) for o in outs]


def _assert_same(got, expected, logprob_atol: float) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected, strict=True):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=logprob_atol, rtol=0)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]


def test_default_model_equals_its_float32_twin(monkeypatch) -> None:
    """Native kernels compute the Q4_1/Q8_0 weights exactly in float32 activations, so greedy tokens
    equal the same file loaded dense (quantization "none"), batched and alone. (The PyTorch path rounds
    activations to bf16 for its int4 kernel and may differ on near ties: "def fibonacci(n):" does.) So
    int4 and the Q8_0 head run in float32 here, not in the bf16 arithmetic CPUs with AVX512_BF16 use by
    default."""
    monkeypatch.setattr(linear, "CPU_INT4_BF16", False)
    monkeypatch.setattr(linear, "CPU_INT8_BF16", False)
    kwargs = {"kv_cache_memory": 0.05, "max_model_len": 256, "engine_process": False}
    dense = _generate(LLM(default_gguf_path(), quantization="none", **kwargs), PROMPTS, 24)
    llm = LLM(default_gguf_path(), **kwargs)
    assert inproc_core(llm).runner.model.model.embed_tokens.screen is None
    _assert_same(_generate(llm, PROMPTS, 24), dense, 2e-3)
    _assert_same(_generate(llm, PROMPTS[1:2], 24), dense[1:2], 2e-3)


def _dense_twin(path: Path, twin: Path, method: str) -> Path:
    """The checkpoint at `path` with every matrix replaced by its dequantized `method` form, as
    `LlamaForCausalLM.quantize` quantizes it (the untied head of an int4 model at int8): a float32
    model holding exactly the quantized model's values."""
    shutil.copytree(path, twin)
    tensors = load_file(twin / "model.safetensors")
    for name, t in tensors.items():
        if t.dim() == 2:
            tensors[name] = dense_weight(quantize(t, "int8" if name == "lm_head.weight" else method))
    save_file(tensors, twin / "model.safetensors", metadata={"format": "pt"})
    return twin


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_tiny_quantized_llama_equals_its_float32_twin(tmp_path, monkeypatch, method: str) -> None:
    """Load-time int4/int8 on a tiny random Llama: with the native kernels, greedy tokens equal the
    float32 model holding the same values, batched and alone, logprobs within float32 noise. The
    PyTorch path (EMBER_CPU_NATIVE=0), whose int4/int8 kernels take bf16 activations, holds to the
    first 12 tokens (its first divergence on these prompts is at token 16) with logprobs within 0.05.
    int4 and int8 run in float32 here (CPU_INT4_BF16, CPU_INT8_BF16), as on CPUs without AVX512_BF16."""
    monkeypatch.setattr(linear, "CPU_INT4_BF16", False)
    monkeypatch.setattr(linear, "CPU_INT8_BF16", False)
    path = make_checkpoint(tmp_path / "llama", "llama")
    twin = LLM(
        str(_dense_twin(path, tmp_path / "twin", method)), kv_cache_memory=0.02, max_model_len=256, engine_process=False
    )
    prompts = ["hello world", "the quick brown fox jumps", "a b c d e f g h i j k l m n o p q r s"]
    expected = _generate(twin, prompts, 40) + _generate(twin, prompts[2:], 40)
    kwargs = {"quantization": method, "kv_cache_memory": 0.02, "max_model_len": 256, "engine_process": False}
    native = LLM(str(path), **kwargs)
    _assert_same(_generate(native, prompts, 40) + _generate(native, prompts[2:], 40), expected, 1e-3)
    monkeypatch.setenv("EMBER_CPU_NATIVE", "0")
    fallback = _generate(LLM(str(path), **kwargs), prompts, 12)
    _assert_same(fallback, [(tokens[:12], logprobs[:12]) for tokens, logprobs in expected[:3]], 5e-2)


def _q5_0(rows: int, cols: int, seed: int) -> QuantizedWeight:
    """A random GGUF Q5_0 matrix as the loader keeps it."""
    raw = random_tensor(QType.Q5_0, (rows, cols), np.random.default_rng(seed), scale=0.5)
    return quantized(raw, QType.Q5_0, (rows, cols))


def test_q5_0_loads_as_the_int5_runs_the_two_pass_path_packed(kernels) -> None:
    """GGUF Q5_0 kept as its blocks' int5 runs (one strided copy) is, bit for bit, the native weight the
    int8 decoding then `pack_q5` made; its expansion is gguf's own decoding, its GEMV the float64 one."""
    raw = random_tensor(QType.Q5_0, (37, 512), np.random.default_rng(0), scale=0.5)
    w = quantized(raw, QType.Q5_0, (37, 512))
    direct, two_pass = ops.native_weight(w), ops.native_weight(widen_int5(w))
    assert (w.kind, direct.kind, two_pass.kind) == ("int5", "int5", "int5")
    assert torch.equal(direct.codes, two_pass.codes) and torch.equal(direct.scales, two_pass.scales)
    assert direct.scales.dtype == torch.float16
    assert torch.equal(ops.dequantize(direct), torch.from_numpy(gguf.quants.dequantize(raw, QType.Q5_0)))
    _check_matmul(torch.randn(3, 512, generator=torch.Generator().manual_seed(3)), w)


def test_q5_0_layers_fuse_as_before(kernels) -> None:
    """q/k/v of Q5_0 fuse into one int5 weight; Q5_0 q/k beside a Q8_0 v are widened and fuse into one
    int8 weight: either way the native weight of the int8 decoding, bit for bit."""
    q, k = _q5_0(64, 256, 1), _q5_0(32, 256, 2)
    v8 = torch.randn(32, 256, generator=torch.Generator().manual_seed(3)).numpy()
    v8 = quantized(gguf.quants.quantize(v8, QType.Q8_0), QType.Q8_0, (32, 256))
    for v, kind in ((_q5_0(32, 256, 4), "int5"), (v8, "int8")):
        (matmul,) = QuantLinear([q, k, v], None, torch.float32).matmuls
        old = ops.native_weight(concat_out([widen_int5(p) for p in (q, k, v)]))
        assert isinstance(matmul, linear.NativeLinear) and matmul.native.kind == old.kind == kind
        assert torch.equal(matmul.native.codes, old.codes) and torch.equal(matmul.native.scales, old.scales)


def test_q5_0_tied_embedding_shares_its_int5_codes(kernels) -> None:
    """A Q5_0 embedding looks rows up from the int5 runs its tied LM head's GEMV reads: one copy of codes."""
    w = _q5_0(40, 256, 5)
    embedding = QuantEmbedding(w, torch.float32, tied=True)
    assert embedding.head is not None
    (matmul,) = embedding.head.matmuls
    assert isinstance(matmul, linear.NativeLinear) and matmul.native.codes.data_ptr() == w.qweight.data_ptr()
    ids = torch.tensor([3, 0, 39, 3])
    assert torch.equal(embedding(ids), dequantize(w)[ids])


@pytest.mark.parametrize("qtype_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"])
def test_tied_embedding_looks_rows_up_natively(kernels, qtype_name: str) -> None:
    """A tied embedding's lookup is one native call over its head's weight (ops.dequantize_rows): the rows
    `dequantize` gives, bit for bit, for every form the native weight takes (float16 scales, Q4_1's runs,
    int5 runs, K-quants' two-level scales); an id past the vocabulary raises IndexError."""
    qtype = QType[qtype_name]
    raw = random_tensor(qtype, (40, 512), np.random.default_rng(7), scale=0.5)
    w = quantized(raw, qtype, (40, 512))
    embedding = QuantEmbedding(w, torch.float32, tied=True)
    assert embedding.native_rows is not None
    ids = torch.tensor([3, 0, 39, 3, 17])
    assert torch.equal(embedding(ids), dequantize(w)[ids])
    assert torch.equal(embedding(ids[:0]), dequantize(w)[ids[:0]])
    with pytest.raises(IndexError, match="row 40 of 40"):
        embedding(torch.tensor([1, 40]))


@pytest.mark.parametrize("qtype_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_two_level_scales(kernels, qtype_name: str) -> None:
    """GGUF K-quants keep their scales and zeros as int8 codes times float16 super-block bases (one byte a
    group): the expansion equals gguf's own decoding bit for bit, the GEMV the float64 reference."""
    qtype = QType[qtype_name]
    shape = (37, 512)
    raw = random_tensor(qtype, shape, np.random.default_rng(0), scale=0.5)
    w = quantized(raw, qtype, shape)
    native = ops.native_weight(w)
    assert native.param_mode == 2
    reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert torch.equal(ops.dequantize(native), reference)
    for m in (1, 3, 9):
        _check_matmul(torch.randn(m, shape[1], generator=torch.Generator().manual_seed(m)), w)
    if w.kind == "int8" and ops.bf16_fits(w):  # Q6_K: groups of 16 in bf16 arithmetic, two-level scales
        x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(5))
        ref, bound = _int58_bf16_reference(x, w)
        assert (ops.matmul(x, ops.native_weight(w, bf16=True)).double() - ref).abs().le(bound).all()
