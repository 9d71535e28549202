"""Scatter the step's new keys and values into their paged-cache slots, quantizing for fp8 caches."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.e4m3 import quantize_e4m3
from ember.quant.formats import FP8_DTYPE
from ember.quant.kv_scale import KVScale, check_kv_scales, quantize_kv


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_ch,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    HEAD_SCALES: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    if HEAD_SCALES:
        k_scale = tl.load(k_scale + heads, mask=heads < num_kv_heads, other=1.0)
        v_scale = tl.load(v_scale + heads, mask=heads < num_kv_heads, other=1.0)
    if FP8:
        k = quantize_e4m3(k, k_scale, ROUND_IN_FP32)
        v = quantize_e4m3(v, v_scale, ROUND_IN_FP32)
    dst = slot * stride_cs + heads * stride_ch + dims
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: KVScale = 1.0,
    v_scale: KVScale = 1.0,
) -> None:
    """Write k, v [T, Hk, D] into caches [num_blocks, block_size, Hk, D] at `slot_mapping` [T].

    k and v may be strided views (e.g. slices of a fused qkv projection) as long as the head
    dimension is contiguous; slot -1 skips the token so padded batches need no host-side filtering.
    fp8 caches store clamp(x / scale, -448, 448) with the layer's scales or each KV head's (see
    `quantize_kv`); other caches need scales of 1.0.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("store_kv: k and v need a contiguous last dimension")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv: k_cache and v_cache must be contiguous")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"store_kv: k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share a dtype")
    check_kv_scales(k_cache.dtype, k_scale, v_scale, num_kv_heads)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=k_cache.dtype == FP8_DTYPE,
        HEAD_SCALES=isinstance(k_scale, torch.Tensor),
        ROUND_IN_FP32=triton.knobs.runtime.interpret,
    )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: KVScale = 1.0,
    v_scale: KVScale = 1.0,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = quantize_kv(k[keep], k_cache.dtype, k_scale)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = quantize_kv(v[keep], v_cache.dtype, v_scale)
