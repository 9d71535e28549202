"""Host-side helpers shared by the kernels: paged-attention argument checks, dot operand types, the
SM count that sizes split grids, and the score scaling for logit soft-capping; plus the one
online-softmax step (`attend_tile`) both attention kernels run."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ember.quant.formats import FP8_DTYPE
from ember.quant.kv_scale import KVScale, check_kv_scales

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_LOG2E = 1.4426950408889634


def check_paged_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: KVScale, v_scale: KVScale
) -> None:
    """q [*, Hq, D] against caches [num_blocks, block_size, Hk, D]. fp8 caches are read into q's
    dtype, so only they may differ from it."""
    num_heads, head_dim = q.shape[-2:]
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} must be a power of two")
    if head_dim != cache_head_dim or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)} and v_cache "
            f"{tuple(v_cache.shape)} disagree on head_dim or cache shape"
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous head dimension")
    if k_cache.dtype != v_cache.dtype or (q.dtype != k_cache.dtype and k_cache.dtype != FP8_DTYPE):
        raise ValueError(
            f"q ({q.dtype}) and the caches ({k_cache.dtype}, {v_cache.dtype}) must share a dtype "
            "unless the caches are fp8"
        )
    check_kv_scales(k_cache.dtype, k_scale, v_scale, num_kv_heads)


def check_window_args(
    sliding_window: int | None, logits_soft_cap: float | None, attention_chunk: int | None = None
) -> None:
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if attention_chunk is not None and (not isinstance(attention_chunk, int) or attention_chunk < 1):
        raise ValueError(f"attention_chunk must be a positive int or None, got {attention_chunk!r}")
    if sliding_window is not None and attention_chunk is not None:
        raise ValueError("sliding_window and attention_chunk: a layer has one or the other")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be a positive float or None, got {logits_soft_cap!r}")


def score_scales(scale: float, k_scale: float, logits_soft_cap: float | None) -> tuple[float, float]:
    """(qk_scale, cap) for `attend_tile`: scores leave the dot product as q.k times qk_scale, in log2
    units so the softmax runs on exp2. Capped, cap * tanh(s / cap) of the natural score s is
    computed as cap * (1 - 2 / (exp(2 s / cap) + 1)), so qk_scale carries 2 / cap and `cap` the
    factor back to log2 units (tanh through exp2: Triton's interpreter has no tanh)."""
    if logits_soft_cap is None:
        return scale * k_scale * _LOG2E, 1.0
    return scale * k_scale * 2 * _LOG2E / logits_soft_cap, logits_soft_cap * _LOG2E


def kernel_scales(
    scale: float, k_scale: KVScale, v_scale: KVScale, logits_soft_cap: float | None
) -> tuple[float, float, KVScale, KVScale, bool]:
    """(qk_scale, cap, k_scale, v_scale, HEAD_SCALES) as the attention kernels take them: a layer's
    k_scale is folded into qk_scale on the host, per-head scales stay tensors that each program reads
    once at its KV head (`head_scales`)."""
    per_head = isinstance(k_scale, torch.Tensor)
    qk_scale, cap = score_scales(scale, 1.0 if isinstance(k_scale, torch.Tensor) else k_scale, logits_soft_cap)
    return qk_scale, cap, k_scale if per_head else 1.0, v_scale, per_head


@triton.jit
def head_scales(qk_scale, k_scale, v_scale, kv_head, HEAD_SCALES: tl.constexpr):
    """The program's (qk_scale, v_scale): with HEAD_SCALES its KV head's k scale joins qk_scale and its
    v scale replaces the layer's."""
    qk = qk_scale
    vs = v_scale
    if HEAD_SCALES:
        qk = qk_scale * tl.load(k_scale + kv_head)
        vs = tl.load(v_scale + kv_head)
    return qk, vs


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (num_heads,) or sinks.stride(0) != 1):
        raise ValueError(
            f"sinks must be a contiguous float32 tensor [{num_heads}] (one per query head), got "
            f"{sinks.dtype} {tuple(sinks.shape)}"
        )


def check_query_limits(query_limits: torch.Tensor | None, num_tokens: int, causal: bool) -> None:
    """The prefill kernel reads one int32 limit per row of q, at the row's index."""
    if query_limits is None:
        return
    if not causal:
        raise ValueError("query_limits: a bidirectional (causal=False) attention already sees every key")
    if query_limits.dtype != torch.int32 or query_limits.shape != (num_tokens,) or query_limits.stride(0) != 1:
        raise ValueError(
            f"query_limits must be a contiguous int32 tensor [{num_tokens}] (one per query token), got "
            f"{query_limits.dtype} {tuple(query_limits.shape)}"
        )


@triton.jit
def init_softmax(sinks_ptr, heads, head_mask, start, ROWS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The online softmax's running max and denominator before any key: -inf and 0, or with sinks, in
    the program that holds a row's first keys (`start`), the head's sink logit in log2 units and its
    exp2(0) = 1: the sink joins the denominator without adding to the accumulator. Padding rows (never
    stored) read a sink of 0."""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m = tl.where(start, sink, m)
        l = tl.where(start, 1.0, l)
    return m, l


@functools.cache
def num_sms(device: torch.device) -> int:
    """The GPU's SM count, which the decode-attention split and split-K aim to fill; off CUDA (the
    interpreter) an H100/H200's 132, so tests choose the grids the GPU would."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The type both attention products multiply in: q's dtype, so bf16/fp16 use tensor cores. It
    is the cache dtype too, except for fp8 caches, whose e4m3 values every one of these types holds
    exactly. bf16 under TRITON_INTERPRET is the one exception: its numpy `tl.dot` would multiply the
    raw uint16 storage; there the operands are upcast (exactly) and only the rounding of the
    softmax probabilities differs from the GPU."""
    if dtype == torch.bfloat16 and triton.knobs.runtime.interpret:
        return tl.float32
    return _TL_DTYPES[dtype]


def kv_dot_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> tl.dtype:
    """The attention kernels' product type. An fp8 cache read by bf16 queries multiplies in fp16:
    Hopper converts a pair of e4m3 values to fp16 in one instruction (cvt.rn.f16x2.e4m3x2) and has
    none to bf16, for which Triton goes e4m3 -> fp16 -> fp32 -> bf16, on every K and V element of
    every tile, which made fp8 caches slower than bf16 ones (0.83x the 0.6B shape's throughput).
    e4m3 values and the softmax probabilities are exact or finer in fp16; queries are rounded to
    fp16's 11-bit mantissa (finer than bf16's) and must stay below its 65504."""
    if cache_dtype == FP8_DTYPE and q_dtype == torch.bfloat16:
        return tl.float16
    return dot_dtype(q_dtype)


# The smallest K tile int4 weights get in a bf16/fp16 dot. Compiled for sm_90 (Triton 3.6), a 16-column tile
# of unpacked nibbles fed to the tensor cores gave wrong products: in the MoE grouped GEMM and one-kernel MLP
# max error 0.29-0.88 against the float64 reference where 32 columns gave 0.0013, and in the dense
# quant_matmul (int4 groups of 16, whose K tile followed the group) 1.52 (H100, 2026-12-07; fp32 and int8
# operands exact at 16). Smaller tiles are raised to it.
INT4_MMA_MIN_K = 32


def int4_k_tile(block_k: int, int4: bool, dtype: torch.dtype) -> int:
    """The K tile a kernel's products run with: at least INT4_MMA_MIN_K for int4 codes in a 16-bit dot."""
    return max(block_k, INT4_MMA_MIN_K) if int4 and dtype in (torch.bfloat16, torch.float16) else block_k


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full precision: TF32 would lose the fp32 path's parity with HF."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def first_key(pos, span, CHUNKED: tl.constexpr):
    """The first key position a query at `pos` sees: its chunk's first, (pos // span) * span (Llama 4's
    chunked attention), or its sliding window's, pos - span + 1 (may be negative: every key)."""
    first = pos - span + 1
    if CHUNKED:
        first = pos // span * span
    return first


@triton.jit
def attend_tile(
    q,
    m_i,
    l_i,
    acc,
    tile,
    kv_end,
    q_pos,
    q_limit,
    k_cache_ptr,
    v_cache_ptr,
    table,
    kv_head,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    qk_scale,
    cap,
    q_first,
    dims,
    dim_mask,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    WINDOW_MASK: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One online-softmax step over context positions [tile, tile + BLOCK_N), shared by the decode and
    prefill kernels. MASKED hides positions at or past `kv_end` and past each row's `q_limit` (its own
    position `q_pos`, or for an image token of a prefill the last token of its image); tiles wholly
    inside every row's visible range skip it. WINDOW_MASK (needs MASKED) also hides positions before
    `q_first`, each row's first visible key (`first_key`: the sliding window's left edge, counted from
    the row's own position whatever its limit, or its attention chunk's start); a row may then see
    nothing in a tile, so its running max can stay -inf and the exponentials are taken against 0.
    SOFT_CAP applies the cap to the scores before masking (`qk_scale` and `cap` from `score_scales`).

    fp8 tiles convert to DOT_DTYPE exactly, unscaled: the caller folds k_scale into `qk_scale` and
    applies v_scale once to the final accumulator, which saves a multiply per element per tile and
    a rounding of the scaled values to bf16/fp16."""
    pos = tile + tl.arange(0, BLOCK_N)
    pos_mask = pos < kv_end
    block = tl.load(table + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    offset = pos % BLOCK_SIZE
    kv_mask = pos_mask[:, None] & dim_mask[None, :]
    k = tl.load(
        k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
        mask=kv_mask,
        other=0.0,
    ).to(DOT_DTYPE)
    v = tl.load(
        v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
        mask=kv_mask,
        other=0.0,
    ).to(DOT_DTYPE)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if SOFT_CAP:
        s = cap * (1.0 - 2.0 / (tl.exp2(s) + 1.0))
    if MASKED:
        visible = (pos[None, :] <= q_limit[:, None]) & pos_mask[None, :]
        if WINDOW_MASK:
            visible = visible & (pos[None, :] >= q_first[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = m_new
    if WINDOW_MASK:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
    return m_new, l_i, acc
