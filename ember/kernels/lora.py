"""LoRA shrink and expand over a per-row adapter slot index (the gathered form, punica's BGMV idea).

`lora_shrink`: xa[t] = A[slots[t]] @ x[t], every slice's rank columns at once, in float32.
`lora_expand`: y[t, start:start + out] += B[slots[t]] @ xa[t, slice's columns], rounded once into y.
Each program takes one row and one tile of output columns and reads only that row's slot's weights;
a row with slot -1 writes zeros (shrink) or nothing (expand). The slot is read on the device, so one
captured CUDA graph serves every mix of adapters. Not built yet: the segmented form (rows of one adapter
grouped, a tensor-core tile per group) that long prefills would want, and fusion with the base GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slots_ptr, out_ptr, K, N, stride_xt, stride_as, stride_an, stride_ot,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    k_end = tl.where(slot >= 0, K, 0)  # a row without an adapter reads nothing and writes zeros
    a_rows = a_ptr + tl.maximum(slot, 0) * stride_as + cols[:, None] * stride_an
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xt + ks, mask=ks < k_end, other=0.0).to(tl.float32)
        a = tl.load(a_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < k_end), other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + row * stride_ot + cols, acc, mask=cols < N)


@triton.jit
def _expand_kernel(
    xa_ptr, b_ptr, slots_ptr, y_ptr, R, N, xa_offset, y_offset, stride_xat, stride_bs, stride_br, stride_yt,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    n_end = tl.where(slot >= 0, N, 0)  # a row without an adapter reads and writes nothing
    rs = tl.arange(0, BLOCK_R)
    xa = tl.load(xa_ptr + row * stride_xat + xa_offset + rs, mask=rs < R, other=0.0)
    b = tl.load(
        b_ptr + tl.maximum(slot, 0) * stride_bs + rs[:, None] * stride_br + cols[None, :],
        mask=(rs[:, None] < R) & (cols[None, :] < n_end),
        other=0.0,
    )
    delta = tl.sum(xa[:, None] * b.to(tl.float32), axis=0)
    y_cols = y_ptr + row * stride_yt + y_offset + cols
    mask = cols < n_end
    y = tl.load(y_cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_cols, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [slots, N, K] (contiguous rows), slots [T] -> float32 [T, N]: row t's A @ x[t]."""
    rows, k = x.shape
    n = a.shape[1]
    out = torch.empty(rows, n, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    block_n = min(64, triton.next_power_of_2(n))
    grid = (rows, triton.cdiv(n, block_n))
    _shrink_kernel[grid](
        x, a, slots, out, k, n, x.stride(0), a.stride(0), a.stride(1), out.stride(0), BLOCK_N=block_n, BLOCK_K=64
    )
    return out


def lora_expand(
    xa: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor, slice_index: int, start: int
) -> None:
    """y[t, start:start + N] += b[slots[t]]^T-applied: b [slots, R, N], its input the slice's R columns of
    xa [T, n_slices * R]; rows with slot -1 are left alone."""
    rows = xa.shape[0]
    r, n = b.shape[1], b.shape[2]
    if rows == 0:
        return
    block_n = min(128, triton.next_power_of_2(n))
    _expand_kernel[(rows, triton.cdiv(n, block_n))](
        xa, b, slots, y, r, n, slice_index * r, start, xa.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_R=triton.next_power_of_2(r), BLOCK_N=block_n,
    )  # fmt: skip


def lora_ref(x: torch.Tensor, a: torch.Tensor, b: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The delta row by row in float64: the tests' reference for both kernels (and TorchLoRA)."""
    rank = b[0].shape[1]
    out = torch.zeros(x.shape[0], sum(t.shape[2] for t in b), dtype=torch.float64, device=x.device)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        xa = a[s].double() @ x[t].double()
        out[t] = torch.cat([xa[i * rank : (i + 1) * rank] @ bi[s].double() for i, bi in enumerate(b)])
    return out
