"""Rotary on the fused QKV output and the keys and values into their cache slots, in one launch.

Unfused, a layer's attention input takes a rotary kernel, a KV store kernel and, for Qwen3, two RMSNorm
launches over the query and key heads: at batch 1 each launch costs 1.4-2.3 us of a decode step on the
H200 whatever its size (Qwen3-30B-A3B's profile, latency-qwen3-30b-a3b-cuda-2026-12-03.json: 100 us of
rotary, 60 of stores and most of 309 us of RMSNorm launches over 48 layers). One program per token
reads its qkv row once: the query heads (normed, rotated) go to a new [T, Hq, D] tensor, the key heads
(normed, rotated) and the value heads straight to the slot. The rounding is the unfused kernels', so
the queries and the cache rows are theirs bit for bit without the QK norm (the norm's fp32 sum of squares
is reduced over two halves instead of one row: the same value up to the order of the additions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.rotary import rotate_heads, table_row


@triton.jit
def _rotary_store_kernel(
    positions_ptr,
    slot_ptr,
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    stride_t,
    stride_table,
    stride_cs,
    num_q_heads,
    num_kv_heads,
    head_dim,
    NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    half = head_dim // 2
    c1, c2, s1, s2 = table_row(cos_ptr, sin_ptr, pos * stride_table, half, dtype, BLOCK_D // 2)
    row = qkv_ptr + token * stride_t
    q_dst = q_out_ptr + token * num_q_heads * head_dim
    rotate_heads(
        row, q_dst, head_dim, head_dim, num_q_heads, c1, c2, s1, s2, half, q_norm_ptr, eps, NORM, BLOCK_HQ, BLOCK_D // 2
    )
    if slot >= 0:  # slot -1: a padding token, whose query is computed and never read
        k_src = row + num_q_heads * head_dim
        k_dst = k_cache_ptr + slot * stride_cs
        rotate_heads(
            k_src,
            k_dst,
            head_dim,
            head_dim,
            num_kv_heads,
            c1,
            c2,
            s1,
            s2,
            half,
            k_norm_ptr,
            eps,
            NORM,
            BLOCK_HK,
            BLOCK_D // 2,
        )
        heads = tl.arange(0, BLOCK_HK)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        offsets = heads * head_dim + dims
        v = tl.load(k_src + num_kv_heads * head_dim + offsets, mask=mask)
        tl.store(v_cache_ptr + slot * stride_cs + offsets, v, mask=mask)


def rotary_store(
    positions: torch.Tensor,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """The rotated queries [T, num_heads, D] of `qkv` [T, (Hq + 2 Hk) D] (rows of any stride), with its
    rotated keys and its values written to caches [blocks, block_size, Hk, D] of qkv's dtype at
    `slot_mapping` (-1 skips a token). `sin_signed` is the sine table with its first half negated
    (RotaryEmbedding.sin_signed); every channel is rotated. `qk_norm`: (q weight, k weight, eps) of an
    RMSNorm over each head applied first (Qwen3)."""
    num_tokens = qkv.shape[0]
    _, _, num_kv_heads, head_dim = k_cache.shape
    if qkv.stride(1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"rotary_store: qkv {tuple(qkv.shape)} must hold {num_heads} query and 2 x {num_kv_heads} KV heads "
            f"of {head_dim} in contiguous rows"
        )
    if (
        k_cache.dtype != qkv.dtype
        or v_cache.dtype != qkv.dtype
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        raise ValueError("rotary_store: the caches must be contiguous and of qkv's dtype (fp8 caches store unfused)")
    if cos.shape[-1] != head_dim or sin_signed.stride() != cos.stride() or cos.stride(1) != 1:
        raise ValueError(f"rotary_store: tables {tuple(cos.shape)} must span head_dim {head_dim}, laid out alike")
    q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q_out
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    _rotary_store_kernel[(num_tokens,)](
        positions,
        slot_mapping,
        qkv,
        cos,
        sin_signed,
        q_out,
        k_cache,
        v_cache,
        q_norm,
        k_norm,
        eps,
        qkv.stride(0),
        cos.stride(0),
        k_cache.stride(1),
        num_heads,
        num_kv_heads,
        head_dim,
        NORM=qk_norm is not None,
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        enable_fp_fusion=False,  # a fused multiply-add would skip the product rounding HF does
    )
    return q_out
