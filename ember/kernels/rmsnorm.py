"""RMSNorm, alone and fused with the residual add, numerically matching HF's LlamaRMSNorm.

One program per row with the whole row in registers (BLOCK = next power of two >= hidden), so the
statistics need a single pass over memory. Inputs may be [rows, hidden] or [T, H, hidden] with
any leading strides: per-head q/k norm then runs directly on views of a fused qkv output.

`rms_norm_fp8` writes the norm's output as the e4m3 codes and scales the fp8 linear reading it takes
(`ember.kernels.fp8_matmul.quantize_fp8`), bit for bit, without the bf16 output and the quantize
launch that reads it back: on the H200 a batch-1 fp8 decode step of Llama-3.1-8B ran 129 quantize
launches (171 us), 64 of them right after these norms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.e4m3 import store_e4m3_groups
from ember.kernels.fp8_matmul import empty_fp8_activation, group_tile
from ember.quant.formats import Fp8Activation, Fp8Layout


@triton.jit
def normed_row(
    x_ptr,
    residual_ptr,
    weight_ptr,
    new_residual_ptr,
    x_offset,
    r_offset,
    row,
    cols,
    mask,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
):
    """One row's weight * (x / rms(x)) in x's dtype; with HAS_RESIDUAL, x + residual is stored to row
    `row` of new_residual and normalised."""
    x = tl.load(x_ptr + x_offset + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + r_offset + cols, mask=mask, other=0.0)
        # HF adds in the model dtype, so the sum is rounded before the norm sees it.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (w * normed).to(x.dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    inner_rows,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    outer = (row // inner_rows).to(tl.int64)
    inner = row % inner_rows
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    y = normed_row(
        x_ptr,
        residual_ptr,
        weight_ptr,
        new_residual_ptr,
        outer * stride_x0 + inner * stride_x1,
        outer * stride_r0 + inner * stride_r1,
        row.to(tl.int64),
        cols,
        mask,
        hidden,
        eps,
        HAS_RESIDUAL,
    )
    tl.store(out_ptr + row.to(tl.int64) * hidden + cols, y, mask=mask)


@triton.jit
def _rms_norm_fp8_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    q_ptr,
    s_ptr,
    new_residual_ptr,
    rows,
    stride_x,
    stride_r,
    stride_sm,
    stride_sg,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    QBLOCK: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < tl.where(row < rows, hidden, 0)  # rows past `rows`: the layout's zero padding, read from nothing
    y = normed_row(
        x_ptr,
        residual_ptr,
        weight_ptr,
        new_residual_ptr,
        row * stride_x,
        row * stride_r,
        row,
        cols,
        mask,
        hidden,
        eps,
        HAS_RESIDUAL,
    )
    store_e4m3_groups(
        y, q_ptr + row * hidden, s_ptr + row * stride_sm, stride_sg, 0, hidden, BLOCK, GROUP, QBLOCK, ROUND_IN_FP32
    )


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"rms_norm: x must be 2-D or 3-D with a contiguous last dim, got {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError("fused_add_rms_norm: residual must match x's shape with a contiguous last dim")
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match hidden size {hidden}")
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    r3 = residual if residual is None or residual.dim() == 3 else residual.unsqueeze(1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = None if residual is None else torch.empty_like(out)
    rows = x3.shape[0] * x3.shape[1]
    if rows == 0:
        return out, new_residual
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows,)](
        x3,
        x3 if r3 is None else r3,
        weight,
        out,
        out if new_residual is None else new_residual,
        x3.stride(0),
        x3.stride(1),
        0 if r3 is None else r3.stride(0),
        0 if r3 is None else r3.stride(1),
        x3.shape[1],
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * (x / rms(x)) over the last dim; a new contiguous tensor of x's dtype.

    The output keeps x's dtype even for an fp32 weight on bf16 x (HF would promote to fp32);
    the engine keeps weights in the model dtype, where the two agree exactly.
    """
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; both new tensors, inputs untouched."""
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None  # _launch returns one whenever it is given a residual
    return out, new_residual


def rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, layout: Fp8Layout
) -> tuple[Fp8Activation, torch.Tensor | None]:
    """quantize_fp8(rms_norm(x)) (with `residual`: of x + residual, returned too) in one launch; x and
    residual [rows, hidden] with contiguous rows."""
    rows, hidden = x.shape
    if x.stride(1) != 1 or (residual is not None and (residual.shape != x.shape or residual.stride(1) != 1)):
        raise ValueError("rms_norm_fp8: x (and residual) must be 2-D alike with a contiguous last dim")
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm_fp8: weight {tuple(weight.shape)} does not match hidden size {hidden}")
    out = empty_fp8_activation(rows, hidden, x.dtype, layout, x.device)
    new_residual = None if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows == 0:
        return out, new_residual
    block, qblock = group_tile(hidden, layout.group_size, triton.next_power_of_2(hidden))
    _rms_norm_fp8_kernel[(out.codes.shape[0],)](
        x,
        x if residual is None else residual,
        weight,
        out.codes,
        out.scales,
        x if new_residual is None else new_residual,
        rows,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        out.scales.stride(0),
        out.scales.stride(1),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        GROUP=layout.group_size,
        QBLOCK=qblock,
        ROUND_IN_FP32=triton.knobs.runtime.interpret,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, new_residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed.to(x.dtype).float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual
