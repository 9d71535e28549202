"""W8A8 fp8: activations quantized per token and group of inputs, and a GEMM over block-scaled
e4m3 weights.

`quantize_fp8` gives each row of x one float32 scale per `group_size` inputs (128 for
block-scaled weights, K for per-channel ones) and writes its e4m3 codes, in one pass over x, in the
layout the linear reading them asks for (`Fp8Layout`). RMSNorm and SiLU-and-mul can write the same
codes and scales themselves (`rms_norm_fp8`, `silu_and_mul_fp8`), which saves the pass.

`fp8_block_matmul` multiplies those codes by e4m3 weight codes on fp8 tensor cores, one K tile per
scale group: each tile's fp32 product is scaled by its row's activation scale and its columns'
weight scales before it joins the accumulator (the DeepSeek-V3 recipe), so the tile product runs
on raw codes and the scales cost two vector loads per K tile. With few rows (decode) the M x N
tiles alone cannot fill 132 SMs, so K is split across programs, whose fp32 partial products the
tile's last program sums in a fixed order (`ember.kernels.split_k`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ember.kernels.e4m3 import store_e4m3_groups
from ember.kernels.paged import num_sms
from ember.kernels.split_k import MAX_TILES, sum_splits, tile_counters
from ember.quant.formats import FP8_DTYPE, Fp8Activation, Fp8Layout, QuantizedWeight, dequantize

_MIN_GROUPS_PER_SPLIT = 4  # a split shorter than this spends more on its partial sum than it saves
_MAX_SPLIT_K = 8
_WAVES = 2  # programs per SM that split-K aims for


class Fp8MatmulConfig(NamedTuple):
    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int


# (max M, BLOCK_M, BLOCK_N, num_warps, num_stages), first row whose max M covers M wins; BLOCK_K is
# the weight's group (128). Starting points from vLLM's untuned defaults for block fp8 on Hopper;
# benchmarks/fp8_gemm.py times each row at every M it covers.
_TILES = (
    (16, 16, 64, 4, 4),
    (64, 64, 64, 4, 4),
    (256, 64, 128, 4, 3),
    (None, 128, 128, 8, 3),
)


@triton.jit
def _quantize_groups_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    rows,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sg,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * GROUP
    j = tl.arange(0, BLOCK)
    mask = (j < GROUP) & (first + j < tl.where(row < rows, K, 0))  # rows past `rows`: the zero padding
    x = tl.load(x_ptr + row * stride_xm + first + j, mask=mask, other=0.0)
    store_e4m3_groups(
        x, q_ptr + row * stride_qm, s_ptr + row * stride_sm, stride_sg, first, K, BLOCK, GROUP, BLOCK, ROUND_IN_FP32
    )


def empty_fp8_activation(
    rows: int, k: int, dtype: torch.dtype, layout: Fp8Layout, device: torch.device
) -> Fp8Activation:
    """Uninitialised codes and scales for `rows` rows of k inputs in `layout` (its padding rows included)."""
    padded = rows + -rows % layout.row_multiple
    groups = triton.cdiv(k, layout.group_size)
    codes = torch.empty(padded, k, dtype=FP8_DTYPE, device=device)
    scales = (
        torch.empty(groups, padded, dtype=torch.float32, device=device).t()
        if layout.column_major_scales
        else torch.empty(padded, groups, dtype=torch.float32, device=device)
    )
    return Fp8Activation(codes, scales, rows, dtype, layout)


def group_tile(k: int, group_size: int, block: int) -> tuple[int, int]:
    """(BLOCK, QBLOCK) for a kernel that quantizes tiles of a row of k values (`store_e4m3_groups`)
    where it would otherwise take tiles of `block` (a power of two): a group of k or more inputs (a
    per-channel weight's) puts the whole row in one tile, a power-of-two group tiles of whole groups."""
    if group_size >= k:
        whole = triton.next_power_of_2(k)
        return whole, whole
    if group_size & (group_size - 1):
        raise ValueError(
            f"fused fp8 quantization takes a power-of-two group or one of all {k} inputs, got {group_size}"
        )
    return max(block, group_size), group_size


def quantize_fp8(x: torch.Tensor, layout: Fp8Layout) -> Fp8Activation:
    """x [M, K] -> its e4m3 codes and float32 scales in `layout`, bit for bit
    `ember.quant.quantize.quantize_fp8_activations` (padding rows: codes 0, the smallest scale)."""
    m, k = x.shape
    if x.stride(1) != 1:
        raise ValueError("quantize_fp8: x needs a contiguous last dimension")
    out = empty_fp8_activation(m, k, x.dtype, layout, x.device)
    q, scales = out.codes, out.scales
    if m:
        block = triton.next_power_of_2(layout.group_size)
        _quantize_groups_kernel[(q.shape[0], scales.shape[1])](
            x,
            q,
            scales,
            m,
            k,
            x.stride(0),
            q.stride(0),
            scales.stride(0),
            scales.stride(1),
            GROUP=layout.group_size,
            BLOCK=block,
            ROUND_IN_FP32=triton.knobs.runtime.interpret,
            num_warps=max(1, min(16, block // 256)),
        )
    return out


def quantize_fp8_groups(
    x: torch.Tensor, group_size: int, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> e4m3 codes [M, K] and float32 scales [M, ceil(K / group_size)] (`quantize_fp8`).
    `column_major_scales` lays the scales out with stride (1, M), as cuBLAS's blockwise
    `torch._scaled_mm` reads them."""
    out = quantize_fp8(x, Fp8Layout(group_size, column_major_scales))
    return out.codes, out.scales


@triton.jit
def _fp8_block_matmul_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    groups_per_split,
    stride_am,
    stride_asm,
    stride_asg,
    stride_bn,
    stride_bsn,
    stride_bsg,
    stride_om,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows_a = offs_m.to(tl.int64)
    rows_b = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = split * groups_per_split
    last = tl.minimum(first + groups_per_split, tl.cdiv(K, BLOCK_K))
    for g in range(first, last):
        k = g * BLOCK_K + offs_k
        k_mask = k < K
        a = tl.load(a_ptr + rows_a[:, None] * stride_am + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptr + rows_b[None, :] * stride_bn + k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        a_scale = tl.load(a_scale_ptr + rows_a * stride_asm + g * stride_asg, mask=m_mask, other=0.0)
        b_scale = tl.load(b_scale_ptr + (offs_n // BLOCK_ROWS) * stride_bsn + g * stride_bsg, mask=n_mask, other=0.0)
        if UPCAST:  # the interpreter's numpy dot would multiply fp8's raw bytes; e4m3 -> fp32 is exact
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        acc, is_last = sum_splits(acc, part_ptr, count_ptr, offs_m, offs_n, out_mask, M, N)
    else:
        is_last = True
    if is_last:
        out = out_ptr + rows_a[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def choose_fp8_matmul_config(m: int, n: int, k: int, group_size: int, num_sms: int) -> Fp8MatmulConfig:
    """Tiles by M, then split-K until the M x N tiles give about _WAVES programs per SM, each split
    keeping at least _MIN_GROUPS_PER_SPLIT K groups."""
    _, block_m, block_n, warps, stages = next(t for t in _TILES if t[0] is None or m <= t[0])
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    groups = triton.cdiv(k, group_size)
    split = min(_MAX_SPLIT_K, triton.cdiv(_WAVES * num_sms, tiles), max(1, groups // _MIN_GROUPS_PER_SPLIT))
    return Fp8MatmulConfig(block_m, block_n, max(1, split), warps, stages)


def _check_weight(w: QuantizedWeight) -> None:
    g = w.group_size
    if w.kind != "fp8" or g < 16 or g & (g - 1):
        raise ValueError(
            f"fp8_block_matmul takes fp8 weights with a power-of-two group of 16 or more inputs, "
            f"got {w.kind} with groups of {g}"
        )


def fp8_block_matmul(
    xq: torch.Tensor,
    x_scales: torch.Tensor,
    w: QuantizedWeight,
    out_dtype: torch.dtype,
    config: Fp8MatmulConfig | None = None,
) -> torch.Tensor:
    """xq [M, K] e4m3 with scales [M, K / g] (`quantize_fp8_groups` with the weight's g) times W^T,
    W e4m3 [N, K] with scales [N / block_rows, K / g] -> [M, N] in `out_dtype`."""
    _check_weight(w)
    m, k = xq.shape
    n = w.out_features
    if k != w.in_features:
        raise ValueError(f"fp8_block_matmul: x has {k} inputs, the weight {w.in_features}")
    cfg = config or choose_fp8_matmul_config(m, n, k, w.group_size, num_sms(xq.device))
    groups = triton.cdiv(k, w.group_size)
    per_split = triton.cdiv(groups, cfg.split_k)
    split = triton.cdiv(groups, per_split)
    grid_m, grid_n = triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n)
    if grid_m * grid_n > MAX_TILES:  # more tiles than split-K counters: no split
        per_split, split = groups, 1
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    part = torch.empty(split, m, n, dtype=torch.float32, device=xq.device) if split > 1 else out
    _fp8_block_matmul_kernel[(grid_m, grid_n, split)](
        xq,
        x_scales,
        w.qweight,
        w.scales,
        out,
        part,
        tile_counters(xq.device),
        m,
        n,
        k,
        per_split,
        xq.stride(0),
        x_scales.stride(0),
        x_scales.stride(1),
        w.qweight.stride(0),
        w.scales.stride(0),
        w.scales.stride(1),
        out.stride(0),
        BLOCK_ROWS=w.block_rows,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=w.group_size,
        SPLIT=split > 1,
        UPCAST=triton.knobs.runtime.interpret,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def fp8_block_matmul_ref(
    xq: torch.Tensor, x_scales: torch.Tensor, w: QuantizedWeight, out_dtype: torch.dtype
) -> torch.Tensor:
    """The float64 product of the dequantized activations and weight."""
    cols = torch.arange(xq.shape[1], device=xq.device) // w.group_size
    x = xq.double() * x_scales.double()[:, cols]
    return (x @ dequantize(w, torch.float64).t()).to(out_dtype)
