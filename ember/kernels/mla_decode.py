"""Multi-head latent attention for one-token queries over the paged latent cache (DeepSeek's MLA,
ember/model/mla.py), split over the context; and the store of a step's latent rows.

Every head of a sequence reads the same cached row per token (the latent c of `kv_lora_rank` values, then
the rotated key k_pe), so this is MQA with one wide "head": one program owns BLOCK_H query heads of one
sequence and one context split, reads each row tile once for all of them, and computes
s = q_lat . c + q_pe . k_pe (two products: the latent and the rotated parts are masked separately, so
neither width need be a power of two) and o += p . c. The query comes absorbed (q_nope through W_UK, by
the caller) and the output stays latent ([B, H, kv_lora_rank]; W_UV is the caller's too). The split's
partial results are merged by decode_attention's log-sum-exp kernel, as paged decode's are.

An fp8 cache (`--kv-cache-dtype fp8`) holds each row as e4m3 under the fp8 KV cache's scale rules
(ember.quant.kv_scale), the latent row being the layer's one KV head: the store quantizes with
`quantize_e4m3`, and the decode kernel converts the e4m3 tiles in registers as paged decode does (the
scale folded into the score scale and applied once to the accumulator; products in fp16 for bf16 queries).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.decode_attention import choose_num_splits, merge_splits
from ember.kernels.e4m3 import quantize_e4m3
from ember.kernels.paged import dot_precision, head_scales, kernel_scales, kv_dot_dtype, num_sms
from ember.quant.formats import FP8_DTYPE
from ember.quant.kv_scale import KVScale, check_kv_scales, dequantize_kv, quantize_kv

BLOCK_N = 32  # context tokens per row tile
BLOCK_H = 16  # query heads per program: the tensor cores' minimum


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    qk_scale,
    k_scale,
    v_scale,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_bt,
    num_heads,
    kv_lora,
    rope_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HEAD_SCALES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    split = tl.program_id(2)
    # an fp8 row's scale, as key in the scores' scale and as value once on the accumulator
    qk_scale, v_scale = head_scales(qk_scale, k_scale, v_scale, 0, HEAD_SCALES)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    ldims = tl.arange(0, BLOCK_L)
    rdims = tl.arange(0, BLOCK_R)
    lmask = ldims < kv_lora
    rmask = rdims < rope_dim
    q_rows = q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + ldims[None, :], mask=head_mask[:, None] & lmask[None, :], other=0.0).to(DOT_DTYPE)
    q_pe = tl.load(q_rows + kv_lora + rdims[None, :], mask=head_mask[:, None] & rmask[None, :], other=0.0).to(DOT_DTYPE)

    seq_len = tl.load(seq_lens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        rows = cache_ptr + block * stride_cb + (pos % BLOCK_SIZE) * stride_cs
        lat = tl.load(rows[:, None] + ldims[None, :], mask=pos_mask[:, None] & lmask[None, :], other=0.0)
        pe = tl.load(rows[:, None] + kv_lora + rdims[None, :], mask=pos_mask[:, None] & rmask[None, :], other=0.0)
        lat = lat.to(DOT_DTYPE)
        s = tl.dot(q_lat, tl.trans(lat), input_precision=PRECISION)
        s += tl.dot(q_pe, tl.trans(pe.to(DOT_DTYPE)), input_precision=PRECISION)
        s = tl.where(pos_mask[None, :], s * qk_scale, float("-inf"))  # log2 units: exp2 below
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), lat, input_precision=PRECISION)
        m_i = m_new
    acc = acc * v_scale

    out_mask = head_mask[:, None] & lmask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a zero-length (padded) sequence: zeros
        dst = out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + ldims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # scratch [B, H, NUM_SPLITS] (+ [kv_lora]) in fp32, as merge_splits reads it
        part = (seq * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=head_mask)
        tl.store(part_sum_ptr + part, l_i, mask=head_mask)
        tl.store(part_acc_ptr + part[:, None] * kv_lora + ldims[None, :], acc, mask=out_mask)


def mla_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    kv_scale: KVScale = 1.0,
) -> torch.Tensor:
    """q [B, H, kv_lora_rank + rope] (absorbed queries) against each sequence's `seq_lens[b]` cached rows
    (cache [num_blocks, block_size, 1, kv_lora_rank + rope]) -> out [B, H, kv_lora_rank]: softmax(q . row *
    scale) . row[:kv_lora_rank], an fp8 cache's rows read as float(stored) * kv_scale. Reads nothing on the
    host (CUDA graphs): the split count is `num_splits`, else from `max_seq_len`, else from the block
    table's width."""
    batch, num_heads, width = q.shape
    num_blocks, block_size, one, cache_dim = cache.shape
    if one != 1 or cache_dim != width or not cache.is_contiguous() or q.stride(2) != 1:
        raise ValueError(
            f"mla_decode_attention: q [B, H, {cache_dim}] with a contiguous last dim and a contiguous cache "
            f"[N, S, 1, {cache_dim}] expected, got {tuple(q.shape)} and {tuple(cache.shape)}"
        )
    if not 0 < kv_lora_rank < width:
        raise ValueError(f"mla_decode_attention: kv_lora_rank {kv_lora_rank} must lie in (0, {width})")
    if cache.dtype not in (q.dtype, FP8_DTYPE):
        raise ValueError(f"mla_decode_attention: a {cache.dtype} cache for {q.dtype} queries (only fp8 may differ)")
    check_kv_scales(cache.dtype, kv_scale, kv_scale, 1)
    qk_scale, _, k_scale, v_scale, per_head = kernel_scales(scale, kv_scale, kv_scale, None)
    if out is None:
        out = torch.empty(batch, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    head_blocks = triton.cdiv(num_heads, BLOCK_H)
    if num_splits is None:
        max_context = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
        num_splits = choose_num_splits(batch, head_blocks, max_context, num_sms(q.device))
    if num_splits > 1:
        part_acc = torch.empty(batch, num_heads, num_splits, kv_lora_rank, dtype=torch.float32, device=q.device)
        part_max = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused: the kernel writes the output directly
    block_l = max(16, triton.next_power_of_2(kv_lora_rank))
    _mla_decode_kernel[(batch, head_blocks, num_splits)](
        q,
        cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_max,
        part_sum,
        qk_scale,
        k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        num_heads,
        kv_lora_rank,
        width - kv_lora_rank,
        NUM_SPLITS=num_splits,
        BLOCK_SIZE=block_size,
        BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N,
        BLOCK_L=block_l,
        BLOCK_R=max(16, triton.next_power_of_2(width - kv_lora_rank)),
        HEAD_SCALES=per_head,
        DOT_DTYPE=kv_dot_dtype(q.dtype, cache.dtype),
        PRECISION=dot_precision(q.dtype),
        num_warps=4 if block_l <= 256 else 8,
        num_stages=2,
    )
    if num_splits > 1:
        merge_splits(out, part_acc, part_max, part_sum, kv_lora_rank, block_l)
    return out


def mla_decode_attention_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    kv_scale: KVScale = 1.0,
) -> torch.Tensor:
    """The same in float64 PyTorch over the dequantized rows, one sequence at a time: [B, H, kv_lora_rank]
    float64."""
    outs = []
    block_size = cache.shape[1]
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        rows = cache[block_tables[b, : -(-n // block_size)].long()].flatten(0, 1)[:n]  # [n, 1, D]
        rows = dequantize_kv(rows, kv_scale, torch.float64).double()[:, 0]
        probs = torch.softmax(q[b].double() @ rows.t() * scale, dim=-1)
        outs.append(probs @ rows[:, :kv_lora_rank])
    return torch.stack(outs)


@triton.jit
def store_cache_values(dst, x, mask, scale, FP8: tl.constexpr, HEAD_SCALES: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """x at `dst` as the latent cache holds it: an fp8 cache clamp(x / scale, -448, 448) in e4m3 (`scale`
    a float, or with HEAD_SCALES a pointer to the one float32), any other cache x as is."""
    if FP8:
        if HEAD_SCALES:
            scale = tl.load(scale)
        x = quantize_e4m3(x, scale, ROUND_IN_FP32)
    tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


def cache_store_flags(cache: torch.Tensor, kv_scale: KVScale) -> dict[str, bool]:
    """The constexprs of `store_cache_values` for `cache` and `kv_scale`."""
    return {
        "FP8": cache.dtype == FP8_DTYPE,
        "HEAD_SCALES": isinstance(kv_scale, torch.Tensor),
        "ROUND_IN_FP32": triton.knobs.runtime.interpret,
    }


@triton.jit
def _store_latent_kernel(
    rows_ptr,
    cache_ptr,
    slot_ptr,
    scale,
    stride_r,
    width,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,
    HEAD_SCALES: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token
        return
    dims = tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + token.to(tl.int64) * stride_r + dims, mask=dims < width)
    store_cache_values(cache_ptr + slot * width + dims, row, dims < width, scale, FP8, HEAD_SCALES, ROUND_IN_FP32)


def store_latent(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scale: KVScale = 1.0) -> None:
    """rows [T, cache_dim] into cache [num_blocks, block_size, 1, cache_dim] at `slot_mapping` [T]; slot -1
    skips the token (a CUDA graph's padding). An fp8 cache stores clamp(row / kv_scale, -448, 448), as
    store_kv stores keys."""
    tokens, width = rows.shape
    if rows.stride(1) != 1 or not cache.is_contiguous() or cache.shape[-1] != width or cache.shape[2] != 1:
        raise ValueError(f"store_latent: rows [T, {cache.shape[-1]}] and a contiguous [N, S, 1, D] cache expected")
    check_kv_scales(cache.dtype, kv_scale, kv_scale, 1)
    if tokens:
        _store_latent_kernel[(tokens,)](
            rows,
            cache,
            slot_mapping,
            kv_scale,
            rows.stride(0),
            width,
            BLOCK=triton.next_power_of_2(width),
            **cache_store_flags(cache, kv_scale),
        )


def store_latent_ref(
    rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scale: KVScale = 1.0
) -> None:
    keep = slot_mapping >= 0
    rows = quantize_kv(rows[keep][:, None], cache.dtype, kv_scale).to(cache.dtype)
    cache.view(-1, *cache.shape[2:])[slot_mapping[keep]] = rows
