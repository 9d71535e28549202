"""Neox-style rotary embedding (rotate halves) on q and k, with HF's rounding order.

HF computes `q * cos + rotate_half(q) * sin` in the model dtype after casting the fp32 tables to
it, so every product and the sum are rounded separately. The kernel rounds at the same three
points (with multiply-add fusion off, which would skip one), so the results match HF bit for bit
rather than merely to within tolerance, which keeps greedy decoding identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def head_tile(num_heads, half, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """A tile of a token's heads (rows) by the channels of one half (columns), and which of it is real."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    return heads, cols, (heads < num_heads) & (cols < half)


@triton.jit
def rotated_halves(
    src,
    stride_src_h,
    num_heads,
    c1,
    c2,
    s1,
    s2,
    half,
    norm_ptr,
    eps,
    NORM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """The rotated halves (out[:half], out[half:], in src's dtype) of the heads of one token at `src` (its
    first element): out[:half] = x1 c1 + x2 s1, out[half:] = x2 c2 + x1 s2, with s1 the negated sine
    (`sin_signed`'s first half: the negation is exact, so the sum equals HF's x1 cos - x2 sin), each
    product rounded to the model dtype as HF rounds it. x1 and x2 are a head's halves, or with
    INTERLEAVED its even and odd channels (DeepSeek's pairs (2j, 2j + 1), which transformers rotates as
    the neox halves of the de-interleaved head). NORM: Qwen3's RMSNorm of each head first (weight at
    `norm_ptr`), rounded where rmsnorm.py's kernel rounds: the normed value, then the weighted one."""
    heads, cols, mask = head_tile(num_heads, half, BLOCK_H, BLOCK_HALF)
    step, pair = 1, half  # x1 at channel `step * j` of a head, x2 `pair` channels on
    if INTERLEAVED:
        step, pair = 2, 1
    first = src + heads * stride_src_h + step * cols
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + pair, mask=mask, other=0.0)
    dtype = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    if NORM:
        inv_rms = tl.rsqrt((tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / (2 * half) + eps)[:, None]
        w1 = tl.load(norm_ptr + cols, mask=cols < half, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + cols + half, mask=cols < half, other=0.0).to(tl.float32)
        x1f = (w1 * (x1f * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2f = (w2 * (x2f * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    o1 = (x1f * c1).to(dtype).to(tl.float32) + (x2f * s1).to(dtype).to(tl.float32)
    o2 = (x2f * c2).to(dtype).to(tl.float32) + (x1f * s2).to(dtype).to(tl.float32)
    return o1.to(dtype), o2.to(dtype)


@triton.jit
def rotate_heads(
    src,
    dst,
    stride_src_h,
    stride_dst_h,
    num_heads,
    c1,
    c2,
    s1,
    s2,
    half,
    norm_ptr,
    eps,
    NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr = False,
):
    """`rotated_halves` of one token's heads at `src`, stored as neox halves at `dst` (each a token's
    first element)."""
    o1, o2 = rotated_halves(
        src, stride_src_h, num_heads, c1, c2, s1, s2, half, norm_ptr, eps, NORM, INTERLEAVED, BLOCK_H, BLOCK_HALF
    )
    heads, cols, mask = head_tile(num_heads, half, BLOCK_H, BLOCK_HALF)
    tl.store(dst + heads * stride_dst_h + cols, o1, mask=mask)
    tl.store(dst + heads * stride_dst_h + cols + half, o2, mask=mask)


@triton.jit
def table_row(cos_ptr, sin_ptr, row, half, dtype: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """A position's cos and sine halves, cast to the model dtype first as HF casts its tables."""
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = cols < half
    c1 = tl.load(cos_ptr + row + cols, mask=mask, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + row + cols + half, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + row + cols, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + row + cols + half, mask=mask, other=0.0).to(dtype).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_table,
    num_q_heads,
    num_k_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    c1, c2, s1, s2 = table_row(cos_ptr, sin_ptr, pos * stride_table, half, dtype, BLOCK_HALF)
    q_src, q_dst = q_ptr + token * stride_qt, q_out_ptr + token * stride_qot
    rotate_heads(
        q_src,
        q_dst,
        stride_qh,
        stride_qoh,
        num_q_heads,
        c1,
        c2,
        -s1,
        s2,
        half,
        cos_ptr,
        0.0,
        False,
        BLOCK_HQ,
        BLOCK_HALF,
    )
    k_src, k_dst = k_ptr + token * stride_kt, k_out_ptr + token * stride_kot
    rotate_heads(
        k_src,
        k_dst,
        stride_kh,
        stride_koh,
        num_k_heads,
        c1,
        c2,
        -s1,
        s2,
        half,
        cos_ptr,
        0.0,
        False,
        BLOCK_HK,
        BLOCK_HALF,
    )


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by the rows `positions` [T] of cos/sin [max_pos, D].

    The tables are the full-width fp32 ones (cat(freqs, freqs) before cos/sin, as HF and
    `ember.model.layers.RotaryEmbedding` build them); both halves are read, so any table works.
    Returns new contiguous tensors: q and k may be strided views of a fused qkv output and are
    left untouched.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if head_dim % 2 or k.shape[2] != head_dim or cos.shape[-1] != head_dim or sin.shape != cos.shape:
        raise ValueError(
            f"apply_rotary: head_dim {head_dim} must be even and match k {tuple(k.shape)} "
            f"and the tables {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if k.dtype != q.dtype:
        raise ValueError(f"apply_rotary: q ({q.dtype}) and k ({k.dtype}) must share a dtype")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("apply_rotary: q, k and the tables need a contiguous last dim (tables alike)")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos.stride(0),
        num_q_heads,
        num_k_heads,
        head_dim // 2,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        enable_fp_fusion=False,  # a fused multiply-add would skip the product rounding HF does
    )
    return q_out, k_out


def apply_rotary_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
