"""Matrix multiply against int8 or packed-int4 weights, dequantized tile by tile inside the K loop.

Decode multiplies a few rows by every weight, so it is bound by reading the weight: keeping the
codes quantized in HBM and dequantizing in registers cuts that traffic 2-4x against bf16. Each code
dequantizes the way `formats.dequantize` does it (q * scale + zero in fp32) and is rounded once to
the dot dtype, so bf16/fp16 run on tensor cores; fp32 multiplies in full (ieee) precision. Products
accumulate in fp32 and round once to the output dtype.

With few rows the M x N tiles alone cannot fill the GPU, so K is split across programs (split-K):
each split writes an fp32 partial product and a small second kernel sums them in a fixed order
(deterministic, no atomics) and adds the bias.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ember.kernels.paged import dot_dtype, dot_precision, int4_k_tile, num_sms
from ember.quant.formats import QuantizedWeight, dequantize

_KINDS = ("int8", "int4")
_MIN_K_TILES_PER_SPLIT = 2  # a split shorter than this spends more on its partial sum than it saves
_MAX_SPLIT_K = 16
_WAVES = 2  # programs per SM that split-K aims for
_REDUCE_BLOCK_N = 256
_DEQUANT_BLOCK_N = 16
_DEQUANT_BLOCK_K = 256


class QuantMatmulConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


# (max M, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), first row whose max M covers M wins.
# Starting points, not measurements: to be tuned on the H200. Up to 16 rows (decode) the weight
# stream dominates, so BLOCK_M is the tensor-core minimum and long K tiles keep loads in flight.
_TILES = (
    (16, 16, 64, 128, 4, 4),
    (32, 32, 64, 128, 4, 4),
    (64, 64, 64, 128, 4, 3),
    (256, 64, 128, 64, 4, 3),
    (None, 128, 128, 64, 8, 3),
)


def choose_quant_matmul_config(m: int, n: int, k: int, group_size: int, num_sms: int) -> QuantMatmulConfig:
    """Tiles by M, then split-K until the M x N tiles give about _WAVES programs per SM.

    BLOCK_K shrinks to a power-of-two group size, so every K tile lies inside one group and needs one
    scale per column rather than one per element. Tiles never exceed the problem (rounded up to 16,
    the tl.dot minimum), and a split keeps at least _MIN_K_TILES_PER_SPLIT K tiles.
    """
    _, block_m, block_n, block_k, num_warps, num_stages = next(t for t in _TILES if t[0] is None or m <= t[0])
    if group_size >= 16 and group_size & (group_size - 1) == 0:
        block_k = min(block_k, group_size)
    elif group_size < k:
        num_stages = 2  # per-element scale and zero tiles: four stages overflow the H200's shared memory
    block_m = min(block_m, max(16, triton.next_power_of_2(m)))
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split_k = max(1, min(triton.cdiv(_WAVES * num_sms, tiles), k_tiles // _MIN_K_TILES_PER_SPLIT, _MAX_SPLIT_K))
    return QuantMatmulConfig(block_m, block_n, block_k, split_k, num_warps, num_stages)


@triton.jit
def dequant_tile(
    q_ptr,
    scales_ptr,
    zeros_ptr,
    offs_n,
    n_mask,
    k0,
    K,
    num_groups,
    stride_qn,
    stride_sn,
    stride_zn,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    UNIFORM_GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Weight rows `offs_n`, columns [k0, k0 + BLOCK_K), as fp32 [BLOCK_N, BLOCK_K].

    int4 loads the tile's BLOCK_K / 2 bytes per row and interleaves their nibbles, so each byte is
    read once. UNIFORM_GROUP: the whole tile lies in group k0 // GROUP, so one scale per row rather
    than one per element. Elements past K come out finite (code 0 or an odd K's padding nibble),
    which is all a matmul against zero-masked x needs.
    """
    rows = offs_n[:, None].to(tl.int64)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if INT4:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(
            q_ptr + rows * stride_qn + offs_b[None, :], mask=n_mask[:, None] & (offs_b[None, :] < (K + 1) // 2), other=0
        )
        q = tl.interleave(packed & 0xF, packed >> 4).to(tl.float32)
    else:
        q = tl.load(
            q_ptr + rows * stride_qn + offs_k[None, :], mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0
        ).to(tl.float32)
    if UNIFORM_GROUP:
        group = k0 // GROUP
        g_mask = n_mask[:, None]
    else:
        group = offs_k[None, :] // GROUP
        g_mask = n_mask[:, None] & (group < num_groups)
    w = q * tl.load(scales_ptr + rows * stride_sn + group, mask=g_mask, other=0.0)
    if HAS_ZEROS:
        w += tl.load(zeros_ptr + rows * stride_zn + group, mask=g_mask, other=0.0)
    return w


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    q_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    num_groups,
    k_per_split,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_om,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UNIFORM_GROUP: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile over one K split. SPLIT: store the fp32 partial product
    at out_ptr[split] ([split_k, M, N], contiguous) for _split_k_reduce_kernel; else add the bias
    and store the final tile."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)
        w = dequant_tile(
            q_ptr,
            scales_ptr,
            zeros_ptr,
            offs_n,
            n_mask,
            k0,
            K,
            num_groups,
            stride_qn,
            stride_sn,
            stride_zn,
            GROUP,
            INT4,
            HAS_ZEROS,
            UNIFORM_GROUP,
            BLOCK_K,
        )
        acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=PRECISION)

    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        part = out_ptr + (tl.program_id(2).to(tl.int64) * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(part, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_k_reduce_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr
):
    """out[row] = sum of the split partials in split order (+ bias), rounded once."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for split in range(SPLIT_K):
        acc += tl.load(part_ptr + (split * M + row) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_weight(w: QuantizedWeight) -> None:
    if w.kind not in _KINDS:
        raise ValueError(f"quantized kernels take {' or '.join(_KINDS)} weights, not {w.kind}")
    if w.qweight.stride(1) != 1 or w.scales.stride(1) != 1 or (w.zeros is not None and w.zeros.stride(1) != 1):
        raise ValueError("qweight, scales and zeros need a contiguous last dimension")


def matmul_output(op: str, x: torch.Tensor, in_features: int, out_features: int) -> torch.Tensor:
    """Check that x is [M, in_features] with a contiguous last dim (the kernels' pointer arithmetic
    assumes it) and allocate the [M, out_features] result in x's dtype."""
    if x.shape[1] != in_features or x.stride(1) != 1:
        raise ValueError(f"{op}: x {tuple(x.shape)} must be [M, {in_features}] with a contiguous last dim")
    return torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)


def quant_matmul(
    x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None, config: QuantMatmulConfig | None = None
) -> torch.Tensor:
    """x [M, K] @ dequantize(w).T (+ bias) -> [M, N] in x.dtype, reading only w's codes and scales.

    `config` overrides choose_quant_matmul_config (for tuning and tests). A split_k above what K
    allows is lowered so that no split is empty. (An FMA-only GEMV variant for M <= 4 measured 2-3x
    slower than these 16-row tensor-core tiles on the H200: quant-gemm-cuda-gemv-experiment-*.json.)
    """
    _check_weight(w)
    m, k = x.shape
    n = w.out_features
    out = matmul_output("quant_matmul", x, w.in_features, n)
    if m == 0 or n == 0:
        return out
    cfg = config or choose_quant_matmul_config(m, n, k, w.group_size, num_sms(x.device))
    block_k = int4_k_tile(cfg.block_k, w.kind == "int4", x.dtype)
    if block_k != cfg.block_k:  # a tile over more than one group: per-element scales, as a non-power-of-two group
        cfg = cfg._replace(block_k=block_k, num_stages=min(cfg.num_stages, 2))
    k_tiles = triton.cdiv(k, cfg.block_k)
    k_per_split = triton.cdiv(k_tiles, cfg.split_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    zeros = w.zeros if w.zeros is not None else w.scales
    uniform_group = w.group_size % cfg.block_k == 0 or w.group_size >= k
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)
    _quant_matmul_kernel[grid](
        x,
        w.qweight,
        w.scales,
        zeros,
        bias if bias is not None else out,
        part,
        m,
        n,
        k,
        w.num_groups,
        k_per_split,
        x.stride(0),
        w.qweight.stride(0),
        w.scales.stride(0),
        zeros.stride(0),
        out.stride(0),
        GROUP=w.group_size,
        INT4=w.kind == "int4",
        HAS_ZEROS=w.zeros is not None,
        HAS_BIAS=bias is not None,
        UNIFORM_GROUP=uniform_group,
        SPLIT=split_k > 1,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_DTYPE=dot_dtype(x.dtype),
        PRECISION=dot_precision(x.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split_k > 1:
        _reduce_splits(part, bias, out)
    return out


def _reduce_splits(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    split_k, m, n = part.shape
    _split_k_reduce_kernel[(m, triton.cdiv(n, _REDUCE_BLOCK_N))](
        part,
        bias if bias is not None else out,
        out,
        m,
        n,
        out.stride(0),
        SPLIT_K=split_k,
        HAS_BIAS=bias is not None,
        BLOCK_N=_REDUCE_BLOCK_N,
        num_warps=4,
    )


def quant_matmul_ref(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = x.float() @ dequantize(w).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@triton.jit
def _dequantize_kernel(
    q_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    N,
    K,
    num_groups,
    stride_qn,
    stride_sn,
    stride_zn,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w = dequant_tile(
        q_ptr,
        scales_ptr,
        zeros_ptr,
        offs_n,
        n_mask,
        k0,
        K,
        num_groups,
        stride_qn,
        stride_sn,
        stride_zn,
        GROUP,
        INT4,
        HAS_ZEROS,
        False,
        BLOCK_K,
    )
    tl.store(
        out_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :],
        w.to(out_ptr.dtype.element_ty),
        mask=n_mask[:, None] & (offs_k[None, :] < K),
    )


def dequantize_kernel(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense [N, K] weight, as formats.dequantize computes it, for batches large enough that a
    dense (cuBLAS) GEMM beats dequantizing in every tile.

    The multiply and add round separately (no FMA contraction), as PyTorch's do, so the fp32 result
    equals formats.dequantize bit for bit.
    """
    _check_weight(w)
    n, k = w.out_features, w.in_features
    out = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
    if out.numel() == 0:
        return out
    zeros = w.zeros if w.zeros is not None else w.scales
    _dequantize_kernel[(triton.cdiv(n, _DEQUANT_BLOCK_N), triton.cdiv(k, _DEQUANT_BLOCK_K))](
        w.qweight,
        w.scales,
        zeros,
        out,
        n,
        k,
        w.num_groups,
        w.qweight.stride(0),
        w.scales.stride(0),
        zeros.stride(0),
        GROUP=w.group_size,
        INT4=w.kind == "int4",
        HAS_ZEROS=w.zeros is not None,
        BLOCK_N=_DEQUANT_BLOCK_N,
        BLOCK_K=_DEQUANT_BLOCK_K,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out
