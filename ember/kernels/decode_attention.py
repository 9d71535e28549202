"""Paged attention for one-token queries (decode), split over the context for occupancy.

One program owns one (sequence, KV head, context split) and every query head that shares that
KV head, so each K/V tile is read from HBM once per group rather than once per query head: decode
is bandwidth-bound and this is where the GQA saving lives. The group is padded to at least 16
rows so both products are real `tl.dot`s (the tensor-core minimum on every dimension); the padded
rows hold zero queries and are never stored.

With few sequences (B * Hk programs well under the SM count) a long context would run on a few
SMs; splitting it into `num_splits` contiguous ranges fills the GPU, each split writing an
unnormalised partial result that a small second kernel merges by log-sum-exp.

With a sliding window the query at position seq_len - 1 sees only the last `sliding_window`
tokens, so the loop starts exactly at the window's first token (tiles gather token by token, so
they need not align with cache blocks): a long context costs only the window's tiles and no key
left of the window is read, let alone masked. The splits divide the window, and the split count
is sized by it. Llama 4's attention chunk is the same with the loop starting at the chunk's first
token, (seq_len - 1) // chunk * chunk. Soft-capping and windowing are constexpr switches; with both
off the kernel is the one compiled before they existed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ember.kernels.attention_ref import attention_ref, gather_context
from ember.kernels.paged import (
    attend_tile,
    check_paged_args,
    check_sinks,
    check_window_args,
    dot_precision,
    first_key,
    head_scales,
    init_softmax,
    kernel_scales,
    kv_dot_dtype,
    num_sms,
)
from ember.quant.kv_scale import KVScale


class DecodeTile(NamedTuple):
    block_n: int  # context tokens per K/V tile
    num_warps: int
    num_stages: int


# Per cache element width (bytes). bf16, measured on an H200 (D=128): 3.3-4.3 TB/s; BLOCK_N=128 or 8 warps
# were no better. fp8: `benchmarks/fp8_kv_attention.py --sweep` on an H100 (2026-12-06, Llama-8B heads):
# 128 tokens, 3 stages took 248.6 us for 256 sequences of 1,024 tokens and 11.8 us for one of 8,192, against
# 273.4 and 13.4 us at bf16's tile (bf16: 361.2 and 13.3 us), so an fp8 cache now decodes in 0.69x bf16's
# time (the bytes alone would give 0.5x; 1.10x at the old tile on 2026-12-03).
TILES: dict[int, DecodeTile] = {2: DecodeTile(64, 4, 2), 4: DecodeTile(64, 4, 2), 1: DecodeTile(128, 4, 3)}
_MIN_TOKENS_PER_SPLIT = 256  # below this a split costs more in merging than it gains in parallelism
_MAX_SPLITS = 32
_WAVES = 2


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    sinks_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    qk_scale,
    k_scale,
    v_scale,
    cap,
    window,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    group,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WINDOWED: tl.constexpr,
    CHUNKED: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HEAD_SCALES: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    qk_scale, v_scale = head_scales(qk_scale, k_scale, v_scale, kv_head, HEAD_SCALES)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < group
    dim_mask = dims < head_dim
    q_heads = kv_head * group + rows
    q = tl.load(
        q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0
    if WINDOWED:  # `window` holds the window or, CHUNKED, the attention chunk
        first = tl.maximum(first_key(seq_len - 1, window, CHUNKED), 0)
    # Splits get equal whole tiles of this sequence's own (windowed) context, so short sequences
    # in a batch with long ones simply leave their trailing splits empty.
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - first, BLOCK_N), NUM_SPLITS)
    start = first + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    # the sink joins the first split's partial result only, so the merge counts it once
    m_i, l_i = init_softmax(sinks_ptr, q_heads, row_mask, split == 0, GROUP_PAD, HAS_SINKS)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # The query sits at position seq_len - 1, so the causal mask reduces to the split's end.
    q_pos = tl.full([GROUP_PAD], seq_len - 1, tl.int32)
    for tile in range(start, end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q,
            m_i,
            l_i,
            acc,
            tile,
            end,
            q_pos,
            q_pos,
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
            q_pos,  # unread: the loop starts at the first visible key (no WINDOW_MASK)
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
    acc = acc * v_scale  # fp8 values' scale, once per program rather than per tile (see attend_tile)

    out_mask = row_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        # A zero-length sequence (a padded CUDA-graph slot) yields zeros rather than NaN.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # Scratch is [B, Hq, NUM_SPLITS] (+ [head_dim]) in fp32, contiguous.
        part = (seq * (group * tl.num_programs(1)) + q_heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=row_mask)
        tl.store(part_sum_ptr + part, l_i, mask=row_mask)
        tl.store(part_acc_ptr + part[:, None] * head_dim + dims[None, :], acc, mask=out_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    stride_ob,
    stride_oh,
    num_heads,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < NUM_SPLITS
    part = (seq * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(part_max_ptr + part, mask=split_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=split_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * head_dim + dims[None, :],
        mask=split_mask[:, None] & (dims[None, :] < head_dim),
        other=0.0,
    )
    m_max = tl.max(m, axis=0)
    # Empty splits carry m = -inf; if every split is empty the sequence is padding.
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    total = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim
    )


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Split only as far as needed to give the GPU about two waves of programs, and never so far
    that a split of the longest context drops below a few hundred tokens."""
    programs = batch * num_kv_heads
    wanted = triton.cdiv(_WAVES * num_sms, max(programs, 1))
    by_length = triton.cdiv(max_context, _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, _MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    *,
    k_scale: KVScale = 1.0,
    v_scale: KVScale = 1.0,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] attends to its sequence's `seq_lens[b]` cached tokens -> out [B, Hq, D]; with
    `sliding_window` only to the last that many, with `attention_chunk` C (Llama 4) only to those of
    its own chunk, positions (p // C) * C to p, and with `logits_soft_cap` its scaled scores s
    become cap * tanh(s / cap) first (Gemma 2), both as in HF transformers. `sinks` (float32 [Hq],
    gpt-oss) adds exp(sinks[h]) to every softmax denominator of head h.

    An fp8 cache's keys read as float(stored) * k_scale and its values as float(stored) * v_scale
    (host floats for the layer, or float32 tensors [Hk] of one scale per KV head; other caches need
    1.0), the products running in q's dtype (fp16 for bf16 queries, see `kv_dot_dtype`).

    Never reads device values on the host, so it can be captured in a CUDA graph: the split
    count comes from `num_splits`, else from `max_seq_len` (a host int the caller knows), else
    from the block table's width. A captured graph keeps the split count it was captured with;
    every count is correct for every length (splits divide each sequence's own context), so a
    stale one only costs speed.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_paged_args(q, k_cache, v_cache, k_scale, v_scale)
    check_window_args(sliding_window, logits_soft_cap, attention_chunk)
    check_sinks(sinks, num_heads)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    if num_splits is None:
        max_context = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
        max_context = min(max_context, sliding_window or attention_chunk or max_context)
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, num_sms(q.device))
    if num_splits > 1:
        part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused: the kernel writes the final output directly
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot takes K >= 16: small heads padded (masked)
    tile = TILES[k_cache.element_size()]
    qk_scale, cap, k_scale, v_scale, per_head = kernel_scales(scale, k_scale, v_scale, logits_soft_cap)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        q if sinks is None else sinks,
        out,
        part_acc,
        part_max,
        part_sum,
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
        group,
        head_dim,
        NUM_SPLITS=num_splits,
        BLOCK_SIZE=block_size,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_N=tile.block_n,
        BLOCK_D=block_d,
        WINDOWED=sliding_window is not None or attention_chunk is not None,
        CHUNKED=attention_chunk is not None,
        SOFT_CAP=logits_soft_cap is not None,
        HEAD_SCALES=per_head,
        HAS_SINKS=sinks is not None,
        DOT_DTYPE=kv_dot_dtype(q.dtype, k_cache.dtype),
        PRECISION=dot_precision(q.dtype),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    if num_splits > 1:
        merge_splits(out, part_acc, part_max, part_sum, head_dim, block_d)
    return out


def merge_splits(
    out: torch.Tensor,
    part_acc: torch.Tensor,
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    width: int,
    block_d: int,
) -> None:
    """out [B, H, width] from the splits' partial results (part_acc [B, H, NUM_SPLITS, width], part_max and
    part_sum [B, H, NUM_SPLITS], fp32), combined by their log-sum-exp: paged decode's and MLA decode's."""
    batch, num_heads, num_splits = part_max.shape
    _merge_splits_kernel[(batch, num_heads)](
        out,
        part_acc,
        part_max,
        part_sum,
        out.stride(0),
        out.stride(1),
        num_heads,
        width,
        NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
        num_warps=4,
    )


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    *,
    k_scale: KVScale = 1.0,
    v_scale: KVScale = 1.0,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    outs = []
    for b in range(q.shape[0]):
        k, v = gather_context(k_cache, v_cache, block_tables[b], int(seq_lens[b]), k_scale=k_scale, v_scale=v_scale)
        outs.append(
            attention_ref(
                q[b : b + 1],
                k,
                v,
                scale,
                context_len=int(seq_lens[b]) - 1,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
                sinks=sinks,
                attention_chunk=attention_chunk,
            )
        )
    result = torch.cat(outs).to(q.dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result
