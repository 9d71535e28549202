"""Rounding to float8 e4m3 inside Triton kernels, shared by the fp8 KV-cache writes and the fp8
activation quantization (alone, and fused into RMSNorm and SiLU-and-mul)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.quant.formats import FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)
_TINY = tl.constexpr(torch.finfo(torch.float32).tiny)


@triton.jit
def quantize_e4m3(x, scale, ROUND_IN_FP32: tl.constexpr):
    """x / scale saturated to +-448, ready for the store's cast to e4m3 (round to nearest even).

    ROUND_IN_FP32 (the interpreter only, whose fp32 -> fp8 cast rounds ties away from zero and can
    halve a value on a mantissa carry) rounds onto the e4m3 grid first, so the cast is exact: e4m3
    values lie 2^(e-3) apart in [2^e, 2^(e+1)) for e >= -6 and 2^-9 apart below 2^-6; adding
    2^(max(e, -6) + 20) moves |x| to where fp32's own spacing is exactly that, so fp32's
    round-to-nearest-even addition rounds and the subtraction is exact. The GPU's cast rounds
    correctly by itself. The division is IEEE-rounded (`div_rn`): Triton's `/` on fp32 is the GPU's
    approximate division, which left codes one step off PyTorch's on the H200 (every activation case
    of tests/test_fp8.py failed there while passing in the interpreter)."""
    x = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -_FP8_MAX, _FP8_MAX)
    if ROUND_IN_FP32:
        ax = tl.abs(x)
        exponent = ax.to(tl.int32, bitcast=True) >> 23
        magic = ((tl.maximum(exponent, 127 - 6) + 20) << 23).to(tl.float32, bitcast=True)
        r = (ax + magic) - magic
        # The sign bit rather than x < 0, so -0.0 stays -0.0 as in PyTorch's cast.
        x = tl.where(x.to(tl.int32, bitcast=True) < 0, -r, r)
    return x


@triton.jit
def store_e4m3_groups(
    x,
    q_ptr,
    s_ptr,
    stride_sg,
    first_col,
    K,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    QBLOCK: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):
    """Stores x, BLOCK values of one row from column `first_col` (a multiple of GROUP), as e4m3 codes
    at q_ptr + column and one float32 scale per group of GROUP columns at s_ptr + group * stride_sg:
    the scale maps the group's largest |x| to 448 (IEEE division, as PyTorch's; the smallest normal
    for an all-zero group). x must be zero past K. QBLOCK (a power of two dividing BLOCK) is GROUP
    where GROUP is a power of two; one group then covers QBLOCK columns, else BLOCK holds one group."""
    x = tl.reshape(x.to(tl.float32), (BLOCK // QBLOCK, QBLOCK))
    start = first_col + tl.arange(0, BLOCK // QBLOCK) * GROUP
    j = tl.arange(0, QBLOCK)
    cols = start[:, None] + j[None, :]
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), _FP8_MAX), _TINY)
    codes = quantize_e4m3(x, scale[:, None], ROUND_IN_FP32)
    tl.store(q_ptr + cols, codes.to(q_ptr.dtype.element_ty), mask=(j[None, :] < GROUP) & (cols < K))
    tl.store(s_ptr + (start // GROUP) * stride_sg, scale, mask=start < K)
