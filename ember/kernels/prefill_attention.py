"""Paged flash attention for a varlen batch of prompt chunks (prefill, chunked prefill).

Grid (query blocks, sequences, KV heads). A program's BLOCK_M rows are BLOCK_Q consecutive
queries times the GROUP query heads sharing one KV head (row = query * GROUP + head), so each
K/V tile loaded from the paged cache serves the whole group. One-head-per-program would reread
every tile GROUP times; that only stops mattering for long fresh prompts, which are
compute-bound either way, while short chunks over long cached prefixes (chunked prefill,
prefix-cache hits) are bandwidth-bound and gain the full GROUP-fold saving.

Keys are read through the block table one token at a time (a gather of page ids per tile), so
the K/V tile size is independent of the cache's block size. Tiles entirely at or before a
block's first query position need no causal mask; the tail tiles that straddle the diagonal are
masked, and tiles past its last query are never visited.

With a sliding window a query block's tiles start at its first query's window edge, so key
tiles wholly left of every row's window are never read. Tiles from there up to the last query's
window edge are masked on both sides (window and causal); the rest are split as without a window.
Llama 4's attention chunk is the same with each row's first key at its chunk's start, (p // C) * C,
instead of its window's edge (`first_key`): both rise with the row, which is all the tiling assumes.
Soft-capping and windowing are constexpr switches; with both off the kernel is the one compiled
before they existed.

Query limits (Gemma 3's image tokens, `query_limits`) let a row see past its own position, up to its
limit: the tiles before the block's first query stay unmasked, and the masked tail runs on to the
block's furthest limit instead of its last query (a block without image tokens reads the causal
tiles). The window's edge stays at each row's own position. Also a constexpr switch: without limits
the kernel is the causal one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.attention_ref import attention_ref, gather_context
from ember.kernels.paged import (
    attend_tile,
    check_paged_args,
    check_query_limits,
    check_sinks,
    check_window_args,
    dot_precision,
    first_key,
    head_scales,
    init_softmax,
    kernel_scales,
    kv_dot_dtype,
)
from ember.quant.kv_scale import KVScale

_NUM_STAGES = 3


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    query_limits_ptr,
    sinks_ptr,
    out_ptr,
    qk_scale,
    k_scale,
    v_scale,
    cap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WINDOWED: tl.constexpr,
    CHUNKED: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HEAD_SCALES: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_LIMITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    qk_scale, v_scale = head_scales(qk_scale, k_scale, v_scale, kv_head, HEAD_SCALES)

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    first_q = q_block * BLOCK_Q
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q_tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_tok[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=io_mask, other=0.0
    ).to(DOT_DTYPE)
    q_pos = context_len + q_idx

    m_i, l_i = init_softmax(sinks_ptr, heads, row_mask, True, BLOCK_M, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Every row sees positions <= context_len + first_q, so whole tiles up to there skip the causal
    # mask; the block's last query bounds the masked tail. Tiles run from `first` on a BLOCK_N grid.
    q_end = context_len + tl.minimum(first_q + BLOCK_Q, q_len)
    kv_end = q_end
    q_limit = q_pos
    if HAS_LIMITS:
        # An image token sees on to its image's last token, in this chunk: the masked tail runs to the
        # block's furthest limit (never past the sequence). Padding rows read 0; they are not stored.
        q_limit = tl.load(query_limits_ptr + q_tok, mask=row_mask, other=0)
        kv_end = tl.minimum(tl.max(q_limit, axis=0) + 1, seq_len)
    seen_by_all = context_len + first_q + 1
    if not CAUSAL:  # an encoder: every query sees the whole sequence, as a causal query at its end would
        q_pos = tl.zeros_like(q_idx) + seq_len - 1
        q_limit = q_pos
        kv_end = seq_len
        seen_by_all = seq_len
    first = 0
    q_first = q_pos  # each row's first visible key where WINDOWED (`window`: the window or, CHUNKED, the chunk)
    if WINDOWED:
        q_first = first_key(q_pos, window, CHUNKED)
        first = tl.maximum(first_key(context_len + first_q, window, CHUNKED), 0)  # the first query's edge
    unmasked_end = first + (seen_by_all - first) // BLOCK_N * BLOCK_N
    unmasked_start = first
    masked_start = unmasked_end
    if WINDOWED:
        # From the last query's window edge on every row sees every key, so only the tiles before
        # it need the window mask (and the causal one, should they reach the diagonal or a limit).
        all_see = first_key(q_end - 1, window, CHUNKED)
        unmasked_start = first + tl.cdiv(tl.maximum(all_see - first, 0), BLOCK_N) * BLOCK_N
        masked_start = tl.maximum(unmasked_start, unmasked_end)
        for tile in range(first, tl.minimum(unmasked_start, kv_end), BLOCK_N):
            m_i, l_i, acc = attend_tile(
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
                BLOCK_SIZE,
                BLOCK_N,
                True,
                True,
                SOFT_CAP,
                DOT_DTYPE,
                PRECISION,
            )
    for tile in range(unmasked_start, unmasked_end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
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
            BLOCK_SIZE,
            BLOCK_N,
            False,
            False,
            SOFT_CAP,
            DOT_DTYPE,
            PRECISION,
        )
    for tile in range(masked_start, kv_end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
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
            BLOCK_SIZE,
            BLOCK_N,
            True,
            False,
            SOFT_CAP,
            DOT_DTYPE,
            PRECISION,
        )

    if WINDOWED:  # padding rows past the chunk may have seen no key at all; they are not stored
        l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc * v_scale / l_i[:, None]  # v_scale: fp8 values' scale, applied once (see attend_tile)
    tl.store(
        out_ptr + q_tok[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def _block_m(max_query_len: int, group: int) -> int:
    """Rows per program: 128 for long chunks, fewer when every chunk is short so programs are not
    mostly padding; always a power of two >= 16 (tl.dot) and >= the group."""
    rows = triton.next_power_of_2(max(1, max_query_len) * group)
    return max(16, triton.next_power_of_2(group), min(128, rows))


def _tiling(block_m: int, dtype: torch.dtype, block_d: int) -> tuple[int, int]:
    """(K/V tokens per tile, pipeline stages). 128-token tiles pay off (+10-15% on an H200) only with
    full 128-row query tiles; fp32 stays at 64, since 128-token fp32 K/V tiles overflow shared memory
    when pipelined. Heads wider than 128 (Gemma's 256) take 64-token tiles in 2 stages: 128 tokens in 3
    stages asked for 329 KB of the H200's 227 KB."""
    if block_d > 128:
        return 64, 2
    return (128 if block_m >= 128 and dtype != torch.float32 else 64), _NUM_STAGES


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    k_scale: KVScale = 1.0,
    v_scale: KVScale = 1.0,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
    query_limits: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] holds each sequence's chunk at positions seq_lens[b] - q_len .. seq_lens[b] - 1;
    each query attends causally over its whole cached context (with `sliding_window`, over its last
    that many positions, itself included; `causal` False: over the whole sequence, an encoder's
    bidirectional attention, without a window) -> out [T, Hq, D]; `logits_soft_cap` caps the scaled
    scores s to cap * tanh(s / cap) first (Gemma 2); `sinks` (float32 [Hq], gpt-oss) adds exp(sinks[h])
    to every softmax denominator of head h. `query_limits` (int32 [T], causal only) moves each query's
    last visible key from its own position p to its limit L >= p (see `attention_ref`).
    `attention_chunk` C (Llama 4's local layers): a query at p sees only keys (p // C) * C .. p.

    The chunk's own keys and values must already be in the cache. `max_query_len` is a host int
    (the scheduler knows it) that sizes the grid; blocks past a sequence's chunk exit at once.
    An fp8 cache's keys read as float(stored) * k_scale and its values as float(stored) * v_scale
    (host floats for the layer, or float32 tensors [Hk] of one scale per KV head; other caches need
    1.0), the products running in q's dtype (fp16 for bf16 queries, see `kv_dot_dtype`).
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    check_paged_args(q, k_cache, v_cache, k_scale, v_scale)
    check_window_args(sliding_window, logits_soft_cap, attention_chunk)
    check_sinks(sinks, num_heads)
    if not causal and (sliding_window is not None or attention_chunk is not None):
        raise ValueError("sliding_window, attention_chunk: a bidirectional (causal=False) attention has neither")
    check_query_limits(query_limits, num_tokens, causal)
    if out is None:
        out = torch.empty_like(q)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    group = num_heads // num_kv_heads
    block_m = _block_m(max_query_len, group)
    block_q = block_m // group
    grid = (triton.cdiv(max_query_len, block_q), batch, num_kv_heads)
    qk_scale, cap, k_scale, v_scale, per_head = kernel_scales(scale, k_scale, v_scale, logits_soft_cap)
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot takes K >= 16: small heads padded (masked)
    block_n, num_stages = _tiling(block_m, q.dtype, block_d)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        q if query_limits is None else query_limits,
        q if sinks is None else sinks,
        out,
        qk_scale,
        k_scale,
        v_scale,
        cap,
        sliding_window or attention_chunk or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        head_dim,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        WINDOWED=sliding_window is not None or attention_chunk is not None,
        CHUNKED=attention_chunk is not None,
        SOFT_CAP=logits_soft_cap is not None,
        HEAD_SCALES=per_head,
        HAS_SINKS=sinks is not None,
        CAUSAL=causal,
        HAS_LIMITS=query_limits is not None,
        DOT_DTYPE=kv_dot_dtype(q.dtype, k_cache.dtype),
        PRECISION=dot_precision(q.dtype),
        num_warps=8 if block_m >= 128 else 4,
        num_stages=num_stages,
    )
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    k_scale: KVScale = 1.0,
    v_scale: KVScale = 1.0,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
    query_limits: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    result = torch.empty_like(q) if out is None else out
    for b in range(seq_lens.shape[0]):
        start, end, seq_len = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        if end == start:
            continue
        k, v = gather_context(k_cache, v_cache, block_tables[b], seq_len, k_scale=k_scale, v_scale=v_scale)
        result[start:end] = attention_ref(
            q[start:end],
            k,
            v,
            scale,
            context_len=seq_len - (end - start),
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            sinks=sinks,
            causal=causal,
            query_limits=None if query_limits is None else query_limits[start:end],
            attention_chunk=attention_chunk,
        )
    return result
