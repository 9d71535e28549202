"""SwiGLU activation on the fused gate/up projection output, alone or with its output quantized for
the fp8 linear (down_proj) that reads it: `silu_and_mul_fp8` writes the e4m3 codes and scales that
`ember.kernels.fp8_matmul.quantize_fp8` would make of `silu_and_mul`'s output, bit for bit, in the
same launch (a batch-1 fp8 decode step of Llama-3.1-8B on the H200 spent 171 us in 129 quantize
launches, 32 of them right after this kernel)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.e4m3 import store_e4m3_groups
from ember.kernels.fp8_matmul import empty_fp8_activation, group_tile
from ember.quant.formats import Fp8Activation, Fp8Layout

_BLOCK = 1024


@triton.jit
def _silu_and_mul(x_ptr, token, stride_xt, inter, cols, mask):
    """silu(gate) * up of columns `cols` of a token's row, in fp32."""
    gate = tl.load(x_ptr + token * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_xt + inter + cols, mask=mask, other=0.0).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, inter, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    y = _silu_and_mul(x_ptr, token, stride_xt, inter, cols, mask)
    tl.store(out_ptr + token * stride_ot + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    rows,
    stride_xt,
    stride_sm,
    stride_sg,
    inter,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    QBLOCK: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCK
    cols = first + tl.arange(0, BLOCK)
    mask = cols < tl.where(token < rows, inter, 0)  # rows past `rows`: the layout's zero padding, read from nothing
    # rounded to the model dtype first, as silu_and_mul's output is before it is quantized
    y = _silu_and_mul(x_ptr, token, stride_xt, inter, cols, mask).to(x_ptr.dtype.element_ty)
    store_e4m3_groups(
        y,
        q_ptr + token * inter,
        s_ptr + token * stride_sm,
        stride_sg,
        first,
        inter,
        BLOCK,
        GROUP,
        QBLOCK,
        ROUND_IN_FP32,
    )


def _check(x: torch.Tensor) -> int:
    """I, for x [T, 2I] with a contiguous last dim."""
    num_tokens, width = x.shape
    if width % 2 or x.stride(1) != 1:
        raise ValueError(f"silu_and_mul: x must be [T, 2I] with a contiguous last dim, got {tuple(x.shape)}")
    return width // 2


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate | up) -> silu(gate) * up [T, I], in fp32 with a single final rounding."""
    inter = _check(x)
    num_tokens = x.shape[0]
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4
    )
    return out


def silu_and_mul_fp8(x: torch.Tensor, layout: Fp8Layout) -> Fp8Activation:
    """quantize_fp8(silu_and_mul(x), layout) in one launch."""
    inter = _check(x)
    num_tokens = x.shape[0]
    out = empty_fp8_activation(num_tokens, inter, x.dtype, layout, x.device)
    if num_tokens == 0:
        return out
    block, qblock = group_tile(inter, layout.group_size, min(_BLOCK, triton.next_power_of_2(inter)))
    _silu_and_mul_fp8_kernel[(out.codes.shape[0], triton.cdiv(inter, block))](
        x,
        out.codes,
        out.scales,
        num_tokens,
        x.stride(0),
        out.scales.stride(0),
        out.scales.stride(1),
        inter,
        BLOCK=block,
        GROUP=layout.group_size,
        QBLOCK=qblock,
        ROUND_IN_FP32=triton.knobs.runtime.interpret,
        num_warps=max(4, min(16, block // 1024)),
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
