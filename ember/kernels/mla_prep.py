"""The step of DeepSeek's MLA (ember/model/mla.py) between the projections and the attention, in one launch:
the latent's RMSNorm (kv_a_layernorm), the rotary of the query's and the key's rotated channels (DeepSeek's
interleaved pairs read in place), and the cache row [normed latent, rotated k_pe] into its slot.

Why: unfused, this takes 7 launches a layer and step (the latent's copy, the norm, the two
de-interleaving gathers, the rotary, the concatenation, the store); this kernel makes it one.
DeepSeek-V2-Lite's batch-1 decode (27 layers) measured 3.855 ms a token on an H100 against about 1.4 ms of
weight reads, most of the rest launches; at 2-3 us a launch inside a CUDA graph, the 162 launches saved
come to 0.3-0.5 ms a token: an estimate from the launch count, not a measurement. One program per token
reads the projections' outputs where they lie (the query's rotated channels [T, H, rope] and the kv row
[T, kv_lora + rope], strided views), writes the rotated queries to a new [T, H, rope] tensor and the row
to slot_mapping[token] (-1 skips a padding token), quantized for an fp8 cache as `store_latent` quantizes it.

The rounding is the unfused kernels', shared with them: the norm is rmsnorm.py's `normed_row`, the rotary
rotary.py's `rotated_halves`, the fp8 store mla_decode.py's `store_cache_values`; the interpreter gives
their results bit for bit. On the GPU the whole kernel compiles without multiply-add fusion (which the
rotary's product roundings need), so the norm's sum of squares is never contracted into fused
multiply-adds where the RMSNorm kernel's may be: the same value up to that rounding. The launch takes the
RMSNorm kernel's warp count, so its reduction runs over the same layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.mla_decode import cache_store_flags, store_cache_values
from ember.kernels.rmsnorm import normed_row
from ember.kernels.rotary import head_tile, rotate_heads, rotated_halves, table_row
from ember.quant.formats import FP8_DTYPE
from ember.quant.kv_scale import KVScale, check_kv_scales


@triton.jit
def _mla_prep_kernel(
    positions_ptr,
    slot_ptr,
    q_ptr,
    kv_ptr,
    cos_ptr,
    sin_ptr,
    norm_ptr,
    q_out_ptr,
    cache_ptr,
    scale,
    eps,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_table,
    num_heads,
    kv_lora,
    rope_dim,
    INTERLEAVED: tl.constexpr,
    FP8: tl.constexpr,
    HEAD_SCALES: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    half = rope_dim // 2
    c1, c2, s1, s2 = table_row(cos_ptr, sin_ptr, pos * stride_table, half, dtype, BLOCK_HALF)
    q_src, q_dst = q_ptr + token * stride_qt, q_out_ptr + token * num_heads * rope_dim
    rotate_heads(
        q_src,
        q_dst,
        stride_qh,
        rope_dim,
        num_heads,
        c1,
        c2,
        s1,
        s2,
        half,
        norm_ptr,
        eps,
        False,
        BLOCK_H,
        BLOCK_HALF,
        INTERLEAVED,
    )
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # slot -1: a padding token, whose query is computed and never read
        row, dst = kv_ptr + token * stride_kv, cache_ptr + slot * (kv_lora + rope_dim)
        cols = tl.arange(0, BLOCK_L)
        latent = normed_row(row, row, norm_ptr, row, 0, 0, token, cols, cols < kv_lora, kv_lora, eps, False)
        store_cache_values(dst + cols, latent, cols < kv_lora, scale, FP8, HEAD_SCALES, ROUND_IN_FP32)
        k1, k2 = rotated_halves(
            row + kv_lora, 0, 1, c1, c2, s1, s2, half, norm_ptr, eps, False, INTERLEAVED, 1, BLOCK_HALF
        )
        _, k_cols, k_mask = head_tile(1, half, 1, BLOCK_HALF)
        store_cache_values(dst + kv_lora + k_cols, k1, k_mask, scale, FP8, HEAD_SCALES, ROUND_IN_FP32)
        store_cache_values(dst + kv_lora + half + k_cols, k2, k_mask, scale, FP8, HEAD_SCALES, ROUND_IN_FP32)


def mla_prep(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: KVScale = 1.0,
    interleaved: bool = False,
) -> torch.Tensor:
    """The rotated queries [T, H, rope] of `q_pe` [T, H, rope] (the query heads' rotated channels, any
    strides but the last), with kv [T, kv_lora + rope]'s row [rms_norm(latent) * norm_weight, rotated k_pe]
    stored to cache [num_blocks, block_size, 1, kv_lora + rope] at `slot_mapping` [T] (-1 skips a token;
    an fp8 cache holds the row / kv_scale in e4m3). Rotated by the rows `positions` [T] of the tables cos
    and sin_signed [max_positions, rope] (RotaryEmbedding.full_tables); `interleaved`: the rotated channels
    pair as (2j, 2j + 1), and come out as the neox halves of the de-interleaved ones."""
    tokens, num_heads, rope_dim = q_pe.shape
    width = cache.shape[-1]
    kv_lora = width - rope_dim
    if q_pe.stride(2) != 1 or kv.stride(1) != 1 or kv.shape != (tokens, width) or rope_dim % 2:
        raise ValueError(
            f"mla_prep: q_pe [T, H, rope] and kv [T, {width}] with contiguous last dims and an even rope "
            f"expected, got {tuple(q_pe.shape)} and {tuple(kv.shape)}"
        )
    if not cache.is_contiguous() or cache.shape[2] != 1 or cache.dtype not in (kv.dtype, FP8_DTYPE):
        raise ValueError(f"mla_prep: a contiguous [N, S, 1, D] cache of {kv.dtype} or fp8 expected")
    if cos.shape[-1] != rope_dim or sin_signed.stride() != cos.stride() or cos.stride(1) != 1:
        raise ValueError(f"mla_prep: tables {tuple(cos.shape)} must span rope {rope_dim}, laid out alike")
    if norm_weight.shape != (kv_lora,) or q_pe.dtype != kv.dtype:
        raise ValueError(f"mla_prep: a norm weight [{kv_lora}] and q_pe of kv's dtype expected")
    check_kv_scales(cache.dtype, kv_scale, kv_scale, 1)
    q_out = torch.empty(tokens, num_heads, rope_dim, dtype=q_pe.dtype, device=q_pe.device)
    if tokens == 0:
        return q_out
    block_l = triton.next_power_of_2(kv_lora)
    _mla_prep_kernel[(tokens,)](
        positions,
        slot_mapping,
        q_pe,
        kv,
        cos,
        sin_signed,
        norm_weight,
        q_out,
        cache,
        kv_scale,
        eps,
        q_pe.stride(0),
        q_pe.stride(1),
        kv.stride(0),
        cos.stride(0),
        num_heads,
        kv_lora,
        rope_dim,
        INTERLEAVED=interleaved,
        **cache_store_flags(cache, kv_scale),
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_L=block_l,
        BLOCK_HALF=triton.next_power_of_2(rope_dim // 2),
        num_warps=min(16, max(1, block_l // 256)),  # the RMSNorm kernel's (rmsnorm.py): its reduction's layout
        enable_fp_fusion=False,  # a fused multiply-add would skip the product rounding HF does
    )
    return q_out
