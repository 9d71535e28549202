"""fp8 W8A8: block-scaled weight quantization, the per-token-group activation quantizer and the
block-scaled fp8 GEMM against float64 references, and the quantized linear layer's GPU path
against its CPU emulation. fp8 KV caches with per-head scales: the store and attention kernels
against the PyTorch path and the float32 references.

Without a GPU the kernels run in Triton's interpreter: e4m3 loads, stores and fp32 conversions
work there (its fp32 -> e4m3 cast is made exact by `quantize_e4m3`'s ROUND_IN_FP32), but its numpy
`tl.dot` would multiply fp8's raw bytes, so the GEMM upcasts its tiles to fp32 (exactly) before the
dot there; on a GPU the same tests run the fp8 tensor-core dot.
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib

import pytest
import torch

# The interpreter is chosen when the kernels are decorated, so this must precede the import below.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_kernels import fp8_attention_batch, store_and_attend

from ember.kernels import (
    Fp8MatmulConfig,
    choose_fp8_matmul_config,
    fp8_block_matmul,
    fp8_block_matmul_ref,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    quantize_fp8_groups,
    store_kv,
)
from ember.model.linear import QuantEmbedding, QuantLinear
from ember.ops import registry as backend
from ember.quant.formats import FP8_DTYPE, QuantizedWeight, dequantize
from ember.quant.kv_scale import quantize_kv
from ember.quant.quantize import (
    quantize,
    quantize_fp8,
    quantize_fp8_activations,
    quantize_fp8_per_channel,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu())


# ---------------------------------------------------------------- weight quantization


@pytest.mark.parametrize("n,k", [(256, 384), (200, 300), (1, 129)])
def test_block_quantization_scales_each_128x128_tile(n: int, k: int) -> None:
    """One scale per tile (ragged edge tiles included) mapping the tile's largest weight to 448, and
    every weight within e4m3's half step of its code's value."""
    gen = _gen(n, k)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 4
    q = quantize_fp8(w)
    rows, cols = -(-n // 128), -(-k // 128)
    assert q.kind == "fp8" and q.qweight.dtype == FP8_DTYPE and q.block_rows == 128 and q.group_size == 128
    assert q.scales.shape == (rows, cols) and q.scales.dtype == torch.float32
    tile_max = torch.stack(
        [
            torch.stack([w[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128].abs().max() for c in range(cols)])
            for r in range(rows)
        ]
    )
    torch.testing.assert_close(q.scales * 448, tile_max, rtol=1e-6, atol=0)
    err = (dequantize(q) - w).abs()
    scale = dequantize(QuantizedWeight("fp8", torch.ones(n, k).to(FP8_DTYPE), q.scales, None, 128, k, 128))
    normal = w.abs() >= 2**-6 * scale  # e4m3's normal range: 3 mantissa bits, relative step 2^-3
    assert (err[normal] <= w.abs()[normal] * 2**-4 * (1 + 1e-6)).all()
    assert (err[~normal] <= 2**-10 * scale[~normal] * (1 + 1e-6)).all()  # subnormal step 2^-9


def test_per_channel_stays_available_as_ptpc_fp8() -> None:
    w = torch.randn(40, 300, generator=_gen("ptpc"))
    q = quantize(w, "ptpc_fp8")
    assert q.block_rows == 1 and q.group_size == 300 and q.scales.shape == (40, 1)
    assert torch.equal(q.qweight.view(torch.uint8), quantize_fp8_per_channel(w).qweight.view(torch.uint8))
    torch.testing.assert_close(q.scales[:, 0] * 448, w.abs().amax(dim=1), rtol=1e-6, atol=0)


# ---------------------------------------------------------------- activation quantization


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,group", [(5, 300, 128), (3, 256, 128), (4, 200, 200), (1, 1000, 64)])
def test_activation_groups_match_reference_bit_for_bit(m: int, k: int, group: int, dtype: torch.dtype) -> None:
    """Codes and scales exactly as the PyTorch quantizer gives them, over values that saturate,
    round into subnormals, a zero group and a ragged last group."""
    gen = _gen(m, k, group, dtype)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 10
    x[0, :group] = 0.0  # an all-zero group: scale the smallest normal, codes 0
    x[-1, 1:5] = torch.tensor([3e4, -3e-6, 1e-5, -0.0])
    x = x.to(dtype).to(DEVICE)
    q, scales = quantize_fp8_groups(x, group)
    q_ref, scales_ref = quantize_fp8_activations(x.cpu(), group)
    assert q.dtype == FP8_DTYPE and scales.shape == (m, -(-k // group))
    assert bits_equal(q, q_ref)
    assert torch.equal(scales.cpu(), scales_ref)
    assert not q.float().isnan().any()
    col_q, col_scales = quantize_fp8_groups(x, group, column_major_scales=True)
    assert col_scales.stride() == (1, m) and torch.equal(col_scales.cpu(), scales_ref) and bits_equal(col_q, q_ref)


# ---------------------------------------------------------------- block-scaled GEMM


def random_fp8_weight(n: int, k: int, block_rows: int, group: int, gen: torch.Generator) -> QuantizedWeight:
    """Codes over e4m3's whole finite range and scales spread over four decades (so a misplaced scale
    shows); the scales are views into a tensor one row and column wider whose spares are NaN, so a
    read past the weight's blocks poisons the result."""
    codes = (torch.rand(n, k, generator=gen) * 2 - 1) * 448
    rows, cols = -(-n // block_rows), -(-k // group)
    spare = torch.full((rows + 1, cols + 1), float("nan"))
    spare[:rows, :cols] = 10 ** (torch.rand(rows, cols, generator=gen) * 4 - 6)
    return QuantizedWeight(
        "fp8", codes.to(FP8_DTYPE).to(DEVICE), spare[:rows, :cols].to(DEVICE), None, group, k, block_rows
    )


GEMM_CASES = [  # (M, N, K, block_rows, group): ragged N and K edges, per-channel rows, one row (decode)
    (1, 200, 300, 128, 128),
    (17, 130, 257, 128, 128),
    (33, 64, 128, 128, 128),
    (4, 96, 640, 1, 128),
    (2, 48, 160, 128, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,block_rows,group", GEMM_CASES)
def test_block_matmul_matches_float64_reference(
    m: int, n: int, k: int, block_rows: int, group: int, dtype: torch.dtype
) -> None:
    gen = _gen(m, n, k, block_rows, group, dtype)
    w = random_fp8_weight(n, k, block_rows, group, gen)
    x = (torch.randn(m, k, generator=gen) * 3).to(DEVICE)
    xq, x_scales = quantize_fp8_groups(x, group)
    out = fp8_block_matmul(xq, x_scales, w, dtype)
    ref = fp8_block_matmul_ref(xq, x_scales, w, torch.float64)
    assert out.shape == (m, n) and out.dtype == dtype
    # Each output within a fraction of the sum of its products' magnitudes: the interpreter adds in
    # float32; Hopper's fp8 tensor cores keep ~14 mantissa bits while adding up one K group (DeepSeek-V3
    # report, 3.3.2), which left 2.2e-4 of the largest output on the H200 against 1e-5 here.
    rel = {torch.float32: 2**-10 if DEVICE == "cuda" else 1e-5, torch.bfloat16: 1e-2}[dtype]
    abs_w = dataclasses.replace(w, qweight=w.qweight.float().abs().to(FP8_DTYPE))
    magnitude = fp8_block_matmul_ref(xq.float().abs().to(FP8_DTYPE), x_scales, abs_w, torch.float64)
    assert ((out.double() - ref).abs() <= rel * magnitude).all()


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_split_k_sums_every_group_once(split_k: int) -> None:
    """Forced splits, including one that leaves the last split short, give the unsplit result; a second
    call (a CUDA graph replay) gives the same bits, so the tile counters were left at zero."""
    gen = _gen("split", split_k)
    w = random_fp8_weight(72, 7 * 128 - 5, 128, 128, gen)
    x = torch.randn(3, w.in_features, generator=gen).to(DEVICE)
    xq, x_scales = quantize_fp8_groups(x, 128)
    out = fp8_block_matmul(xq, x_scales, w, torch.float32, Fp8MatmulConfig(16, 32, split_k, 4, 2))
    ref = fp8_block_matmul_ref(xq, x_scales, w, torch.float64)
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)
    assert torch.equal(fp8_block_matmul(xq, x_scales, w, torch.float32, Fp8MatmulConfig(16, 32, split_k, 4, 2)), out)


def test_config_splits_k_only_when_tiles_cannot_fill_the_gpu() -> None:
    decode = choose_fp8_matmul_config(1, 4096, 14336, 128, 132)
    prefill = choose_fp8_matmul_config(4096, 4096, 4096, 128, 132)
    assert decode.block_m == 16 and decode.split_k > 1
    assert prefill.split_k == 1 and prefill.block_m >= 64
    assert choose_fp8_matmul_config(1, 64, 256, 128, 132).split_k == 1  # two groups: nothing to split


def test_block_matmul_refuses_other_formats() -> None:
    w = QuantizedWeight("int8", torch.zeros(4, 256, dtype=torch.int8), torch.ones(4, 2), None, 128, 256)
    with pytest.raises(ValueError, match="fp8 weights"):
        fp8_block_matmul(torch.zeros(1, 256, dtype=FP8_DTYPE), torch.ones(1, 2), w, torch.float32)


# ---------------------------------------------------------------- the quantized layers


@pytest.mark.parametrize("method", ["fp8", "ptpc_fp8"])
def test_cpu_emulation_is_w8a8_and_close_to_the_float_layer(method: str) -> None:
    """On CPU an fp8 layer computes exactly the W8A8 product (activation codes times weight codes,
    both scaled), which stays within e4m3's error of the float layer."""
    gen = _gen("emulate", method)
    dense = torch.randn(200, 300, generator=gen) * 0.05
    w = quantize(dense, method)
    layer = QuantLinear([w], None, torch.float32)
    x = torch.randn(6, 300, generator=gen)
    xq, x_scales = quantize_fp8_activations(x, w.group_size)
    out = layer(x)
    torch.testing.assert_close(out.double(), fp8_block_matmul_ref(xq, x_scales, w, torch.float64), atol=1e-5, rtol=1e-5)
    exact = x @ dense.T
    assert torch.linalg.norm(out - exact) <= 0.06 * torch.linalg.norm(exact)


def test_gpu_path_matches_cpu_emulation(monkeypatch) -> None:
    """QuantLinear's block-scaled GPU path (the kernels; forced through the interpreter off a GPU)
    against the CPU emulation of the same weight, a fused q/k/v of three blocks-ragged parts."""
    gen = _gen("gpu-path")
    parts = [quantize_fp8(torch.randn(n, 320, generator=gen) * 0.05) for n in (256, 128, 128)]
    x = torch.randn(5, 320, generator=gen)
    emulated = QuantLinear(parts, None, torch.float32)(x)
    monkeypatch.setattr(backend, "FORCE_TRITON", True)
    on_device = QuantLinear([p.to(DEVICE) for p in parts], None, torch.float32)(x.to(DEVICE))
    torch.testing.assert_close(on_device.cpu(), emulated, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="cuBLAS's blockwise _scaled_mm (gpu_suite.sh runs this on the H200)")
@pytest.mark.parametrize("rows", [128, 129, 200, 257])
def test_blockwise_scaled_mm_rows_match_the_triton_gemm(rows: int) -> None:
    """From FP8_BLOCK_SCALED_MM_MIN_ROWS rows a block-scaled layer runs cuBLAS's blockwise GEMM, its rows
    padded for cuBLAS; any row count gives the Triton block GEMM's result within fp32 summation order."""
    from ember.ops import linear_gpu as linear

    gen = _gen("blockwise", rows)
    w = quantize_fp8(torch.randn(384, 512, generator=gen) * 0.05).to(DEVICE)
    x = torch.randn(rows, 512, generator=gen).to(DEVICE, torch.bfloat16)
    assert linear._block_scaled_mm_fits(rows, w)
    xq, x_scales = quantize_fp8_groups(x, w.group_size)
    triton = fp8_block_matmul(xq, x_scales, w, torch.float32)
    torch.testing.assert_close(QuantLinear([w], None, torch.bfloat16)(x).float(), triton, atol=2e-2, rtol=1e-2)


def test_embedding_rows_read_their_block_scales() -> None:
    """Looking up rows of a block-scaled embedding uses row // 128's scales."""
    dense = torch.randn(300, 64, generator=_gen("embed")) * torch.linspace(0.1, 10, 300)[:, None]
    w = quantize_fp8(dense)
    ids = torch.tensor([0, 127, 128, 299, 5])
    out = QuantEmbedding(w, torch.float32, tied=False)(ids)
    assert torch.equal(out, dequantize(w)[ids])


# ---------------------------------------------------------------- fp8 KV cache with per-head scales


def head_scales(num_kv_heads: int, lo: float, hi: float) -> torch.Tensor:
    """Scales a decade apart across heads, so a head read with its neighbour's scale shows."""
    return torch.logspace(math.log10(lo), math.log10(hi), num_kv_heads, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_head_scales_store_and_attend_like_the_torch_path(dtype: torch.dtype, monkeypatch) -> None:
    """A step of decodes and prefill chunks over fp8 caches with one k and one v scale per KV head,
    through the kernels (store, decode, prefill) and through the PyTorch path: the same cache bits,
    the same attention; and both match the float32 references over the values the caches stand for."""
    head_dim = 64
    meta, cpu = fp8_attention_batch(dtype, 16, 2, head_dim, torch.Generator().manual_seed(4))
    hk = cpu["k"].shape[1]
    scales = {"k_scale": head_scales(hk, 0.002, 0.05), "v_scale": head_scales(hk, 0.03, 0.001)}
    # each head's cached values span its own scale's range, as calibrated per-head scales would see
    for name, s in (("k_cache", scales["k_scale"]), ("v_cache", scales["v_scale"])):
        cpu[name] = quantize_kv(cpu[name].float() * s[:, None] * 100, FP8_DTYPE, s)
    for name, s in (("k", scales["k_scale"]), ("v", scales["v_scale"])):
        cpu[name] = (cpu[name].float() * s[:, None] * 100).to(dtype)

    torch_out, torch_k, torch_v = store_and_attend(meta, cpu, "cpu", scales)
    monkeypatch.setattr(backend, "FORCE_TRITON", True)
    kernel_out, kernel_k, kernel_v = store_and_attend(meta, cpu, DEVICE, scales)
    assert bits_equal(torch_k, kernel_k) and bits_equal(torch_v, kernel_v)
    # outputs are O(v): bf16 rounds q, the probabilities and the output
    tol = {torch.float32: 2e-4, torch.bfloat16: 2e-2}[dtype] * torch_out.float().abs().max().item()
    torch.testing.assert_close(kernel_out.float(), torch_out.float(), atol=tol, rtol=0)

    nd = meta.num_decodes
    decode_ref = paged_decode_attention_ref(
        cpu["q"][:nd].float(), torch_k, torch_v, meta.block_tables[:nd], meta.seq_lens[:nd], head_dim**-0.5, **scales
    )
    prefill_ref = paged_prefill_attention_ref(
        cpu["q"].float(),
        torch_k,
        torch_v,
        meta.block_tables[nd:],
        meta.seq_lens[nd:],
        meta.query_start_loc[nd:],
        meta.max_query_len,
        head_dim**-0.5,
        **scales,
    )
    torch.testing.assert_close(kernel_out[:nd].float(), decode_ref, atol=tol, rtol=0)
    torch.testing.assert_close(kernel_out[nd:].float(), prefill_ref[nd:], atol=tol, rtol=0)


def test_equal_per_head_scales_read_as_the_layer_scale() -> None:
    meta, cpu = fp8_attention_batch(torch.bfloat16, 16, 2, 64, torch.Generator().manual_seed(5))
    hk = cpu["k"].shape[1]
    t = {name: x.to(DEVICE) for name, x in cpu.items()}
    tables, lens = meta.block_tables[:2].to(DEVICE), meta.seq_lens[:2].to(DEVICE)
    layer = paged_decode_attention(
        t["q"][:2], t["k_cache"], t["v_cache"], tables, lens, 0.125, k_scale=0.02, v_scale=0.5
    )
    per_head = paged_decode_attention(
        t["q"][:2],
        t["k_cache"],
        t["v_cache"],
        tables,
        lens,
        0.125,
        k_scale=torch.full((hk,), 0.02, device=DEVICE),
        v_scale=torch.full((hk,), 0.5, device=DEVICE),
    )
    torch.testing.assert_close(per_head, layer, atol=1e-2, rtol=1e-2)


def test_per_head_scales_are_checked() -> None:
    k8 = torch.zeros(2, 16, 4, 64, dtype=FP8_DTYPE, device=DEVICE)
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16, device=DEVICE)
    tables, lens = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE), torch.ones(1, dtype=torch.int32, device=DEVICE)
    four = torch.ones(4, device=DEVICE)
    with pytest.raises(TypeError, match="both float32 tensors"):
        paged_decode_attention(q, k8, k8, tables, lens, 0.125, k_scale=four, v_scale=1.0)
    with pytest.raises(ValueError, match="each of the 4 KV heads"):
        paged_decode_attention(q, k8, k8, tables, lens, 0.125, k_scale=four[:3], v_scale=four[:3])
    with pytest.raises(ValueError, match="only to fp8 caches"):
        store_kv(q, q, q.new_zeros(2, 16, 4, 64), q.new_zeros(2, 16, 4, 64), lens, k_scale=four, v_scale=four)
