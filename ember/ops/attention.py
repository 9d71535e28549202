"""Paged attention over a flat, unpadded batch: Triton kernels on CUDA, PyTorch ops on CPU (the one-token
queries through the native kernel where it takes the cache).

A batch holds `num_decodes` one-token queries first, then prefill chunks. New keys and values are
written into their cache slots, then every query attends to its sequence's cached context plus
itself, found through its block table. On CPU, one-token queries share one padded SDPA call and
each prefill chunk gets its own, with a causal mask offset by the chunk's cached context.

Caches are either in the model's dtype or fp8 (e4m3fn) with scales for keys and for values, one per
layer or one per KV head: a stored value is x / scale saturated to +-448, and reads as
float(stored) * scale.
The scaling rules (check_kv_scales, quantize_kv, dequantize_kv) are ember.quant.kv_scale's, shared
with the kernels' references.

Each implementation `store`s a step's new keys and values and, called, attends (the arguments' meaning
is ember.ops.functional's `store_kv` and `paged_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict, TypeVar

import torch
import torch.nn.functional as F

from ember.cpu_native import ops as native
from ember.ops.target import Target
from ember.quant.formats import FP8_DTYPE
from ember.quant.kv_scale import KVScale, check_kv_scales, dequantize_kv, quantize_kv

# The Triton kernels are imported inside the methods that call them, so CPU-only paths never import Triton.


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (-1: padding, skipped)
    block_tables: torch.Tensor  # [B, W] int32, decode rows first, padded with 0
    seq_lens: torch.Tensor  # [B] int32: context length including the new tokens
    query_start_loc: torch.Tensor  # [B + 1] int32
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    max_query_len: int  # longest prefill chunk (0 when there is none)
    max_seq_len: int  # longest context in the batch (sizes the decode kernel's split)
    seq_lens_host: list[int]  # the same values on the host, for the PyTorch path
    query_start_host: list[int]
    # tokens past query_start_loc[-1] belong to no sequence (a prefill CUDA graph's padding): their attention
    # output is zeros, so that no later op sees uninitialised memory there (a MoE router's NaN, say)
    pad_rows: bool = False
    # int32 [T], the last key position each token's query may see: its own position, or for an image token
    # of Gemma 3 its image's last token, in the same chunk (attention_ref says how windows count). Prefill
    # rows only: decode tokens are never image tokens, so their entries are their positions and are not
    # read. None (every step without images, and CUDA graphs): plain causal, the kernels compiled without.
    query_limits: torch.Tensor | None = None
    # [B] int64, each sequence's slot in the linear-attention state pool (ember/runner/linear_state.py); None
    # for a model without linear-attention layers
    state_slots: torch.Tensor | None = None
    # [B] bool, with state_slots: True where a sequence has no tokens before the step's, so its state starts
    # from zeros (the slot is not cleared when a request takes it)
    state_fresh: torch.Tensor | None = None
    # the PyTorch path's decode gather plans (block ids, keys per query, key mask) per (sliding window,
    # attention chunk) (None, None: global layers), each made by the first layer of a step that uses it
    cpu_decode: dict[tuple[int | None, int | None], tuple[torch.Tensor, int, torch.Tensor | None]] = field(
        default_factory=dict, repr=False
    )


_Pos = TypeVar("_Pos", int, torch.Tensor)  # key positions: one, or a tensor of them


@dataclass(frozen=True)
class Masking:
    """A layer's departures from plain causal softmax attention (see ember.ops.functional.paged_attention)."""

    window: int | None = None
    soft_cap: float | None = None
    sinks: torch.Tensor | None = None
    # False: bidirectional (an encoder, ember/model/bert.py): each prompt's queries see its every key. The
    # scheduler gives such a model whole prompts only, so a query's keys are exactly its step's.
    causal: bool = True
    # Llama 4's chunked local attention: a query at p sees keys from (p // chunk) * chunk to p (no window)
    chunk: int | None = None

    @property
    def local(self) -> bool:
        """Whether a query sees less than its whole causal context (a window or a chunk)."""
        return self.window is not None or self.chunk is not None

    def first_key(self, pos: _Pos) -> _Pos | None:
        """The first key position a causal query at each of `pos` may see; None: the sequence's first."""
        if self.chunk is not None:
            return pos // self.chunk * self.chunk
        if self.window is not None:
            return pos - self.window + 1
        return None


def copy_to_slots(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """values [T, *cache.shape[2:]] into a paged cache at `slot_mapping` [T] (the PyTorch path's store, MLA's
    latent rows too). index_copy_ has no CPU kernel for fp8, so fp8 caches are written through their raw bytes."""
    if cache.dtype == FP8_DTYPE:
        cache, values = cache.view(torch.uint8), values.view(torch.uint8)
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, values)


@dataclass(frozen=True)
class AttentionShape:
    """What the implementations are chosen by, known once a layer's cache is set: the cache's dtype and
    shape, and the query heads attending to it."""

    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


class _KernelMasking(TypedDict):
    """The keyword arguments the Triton decode and prefill kernels share: the cache's scales and the masking."""

    k_scale: KVScale
    v_scale: KVScale
    sliding_window: int | None
    logits_soft_cap: float | None
    sinks: torch.Tensor | None
    attention_chunk: int | None


class TritonAttention:
    @staticmethod
    def can_implement(target: Target, shape: AttentionShape) -> bool:
        return target.triton

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: KVScale,
        v_scale: KVScale,
    ) -> None:
        from ember.kernels import store_kv

        store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: KVScale,
        v_scale: KVScale,
        masking: Masking,
    ) -> torch.Tensor:
        """Each layer passes its own window, cap and sinks (a tensor the kernels read on the device),
        constant from step to step, so one captured CUDA graph replays every layer's kernels with the
        right ones."""
        from ember.kernels import paged_decode_attention, paged_prefill_attention

        out = torch.zeros_like(q) if meta.pad_rows else torch.empty_like(q)
        nd = meta.num_decodes
        kwargs: _KernelMasking = {
            "k_scale": k_scale,
            "v_scale": v_scale,
            "sliding_window": masking.window,
            "logits_soft_cap": masking.soft_cap,
            "sinks": masking.sinks,
            "attention_chunk": masking.chunk,
        }
        if nd:
            paged_decode_attention(
                q[:nd],
                k_cache,
                v_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                scale,
                out=out[:nd],
                max_seq_len=meta.max_seq_len,
                **kwargs,
            )
        if meta.max_query_len:
            # Prefill rows index the full q/out through their own query_start_loc entries.
            paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables[nd:],
                meta.seq_lens[nd:],
                meta.query_start_loc[nd:],
                meta.max_query_len,
                scale,
                out=out,
                causal=masking.causal,
                query_limits=meta.query_limits,
                **kwargs,
            )
        return out


class TorchAttention:
    """One-token queries share one padded SDPA call over their gathered blocks; each prefill chunk gets
    its own, with a causal mask offset by the chunk's cached context (and an image token's row reaching
    on to its query limit)."""

    @staticmethod
    def can_implement(target: Target, shape: AttentionShape) -> bool:
        return True

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: KVScale,
        v_scale: KVScale,
    ) -> None:
        check_kv_scales(k_cache.dtype, k_scale, v_scale, k_cache.shape[2])
        copy_to_slots(k_cache, slot_mapping, quantize_kv(k, k_cache.dtype, k_scale))
        copy_to_slots(v_cache, slot_mapping, quantize_kv(v, v_cache.dtype, v_scale))

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: KVScale,
        v_scale: KVScale,
        masking: Masking,
    ) -> torch.Tensor:
        check_kv_scales(k_cache.dtype, k_scale, v_scale, k_cache.shape[2])
        if meta.num_decodes == q.shape[0]:  # one-token queries only: their SDPA output is the result, no copy
            return self.decode(q, k_cache, v_cache, meta, scale, k_scale, v_scale, masking)
        out = torch.empty_like(q)
        self._prefill(q, k_cache, v_cache, meta, scale, out, k_scale, v_scale, masking)
        return out

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: KVScale,
        v_scale: KVScale,
        masking: Masking,
    ) -> torch.Tensor:
        """The one-token queries q [nd, Hq, D] -> [nd, Hq, D], gathered for one SDPA call."""
        block_size = k_cache.shape[1]
        nd = meta.num_decodes
        plan = (masking.window, masking.chunk)
        if plan not in meta.cpu_decode:
            meta.cpu_decode[plan] = decode_plan(meta, block_size, masking)
        ids, keys, mask = meta.cpu_decode[plan]
        shape = (nd, ids.numel() // nd * block_size, *k_cache.shape[2:])
        # index_select on the flat block list: 1.6x (one sequence) to 12x (16) faster than k_cache[tables]
        k = dequantize_kv(k_cache.index_select(0, ids).view(shape)[:, :keys], k_scale, q.dtype).transpose(1, 2)
        v = dequantize_kv(v_cache.index_select(0, ids).view(shape)[:, :keys], v_scale, q.dtype).transpose(1, 2)
        return _attend(q.unsqueeze(2), k, v, mask, scale, masking).squeeze(2)

    def _prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        k_scale: KVScale,
        v_scale: KVScale,
        masking: Masking,
    ) -> None:
        """fp8 caches are dequantized to q's dtype block by block as they are gathered, never whole. With a
        window, a sequence's blocks wholly before it are not gathered (a 4096-key window on a 32k context
        reads an eighth of the keys)."""
        block_size = k_cache.shape[1]
        nd = meta.num_decodes
        if nd:
            out[:nd] = self.decode(q[:nd], k_cache, v_cache, meta, scale, k_scale, v_scale, masking)
        for i in range(nd, len(meta.seq_lens_host)):
            start, end = meta.query_start_host[i], meta.query_start_host[i + 1]
            q_len, seq_len = end - start, meta.seq_lens_host[i]
            ctx = seq_len - q_len
            first = _first_block(ctx, masking, block_size)
            block_ids = meta.block_tables[i, first : -(-seq_len // block_size)]
            keys = seq_len - first * block_size
            k = dequantize_kv(k_cache.index_select(0, block_ids).flatten(0, 1)[:keys], k_scale, q.dtype).transpose(0, 1)
            v = dequantize_kv(v_cache.index_select(0, block_ids).flatten(0, 1)[:keys], v_scale, q.dtype).transpose(0, 1)
            # A batch dimension of 1: PyTorch's CPU flash kernel takes only 4-d inputs, and 3-d ones fall
            # back to the unfused math path (twice as slow for a 128-token prompt).
            qc = q[start:end].transpose(0, 1)[None]  # [1, Hq, Q, D]
            k, v = k[None], v[None]
            limits = None if meta.query_limits is None else meta.query_limits[start:end]
            if (ctx == 0 and not masking.local and limits is None) or not masking.causal:
                o = _attend(qc, k, v, None, scale, masking, causal=masking.causal and ctx == 0)
            else:
                rows = torch.arange(q_len, device=q.device)[:, None] + ctx
                pos = torch.arange(keys, device=q.device)[None, :] + first * block_size
                # up to its own position or its limit; the window counts from its own (attention_ref's rule)
                mask = pos <= (rows if limits is None else limits[:, None])
                first_key = masking.first_key(rows)
                if first_key is not None:
                    mask &= pos >= first_key
                o = _attend(qc, k, v, mask[None, None], scale, masking)
            out[start:end] = o[0].transpose(0, 1)


class NativeDecodeAttention(TorchAttention):
    """The PyTorch path, its one-token queries read in place from float32 caches by the native kernel
    (ember/cpu_native: no gather, one pass)."""

    @staticmethod
    def can_implement(target: Target, shape: AttentionShape) -> bool:
        return (
            target.native
            and shape.dtype == target.dtype == torch.float32
            and native.attention_shape_fits(shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.block_size)
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: KVScale,
        v_scale: KVScale,
        masking: Masking,
    ) -> torch.Tensor:
        if masking.chunk is not None:  # the native kernel takes one window for all rows, a chunk differs per row
            return super().decode(q, k_cache, v_cache, meta, scale, k_scale, v_scale, masking)
        return native.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            scale,
            window=masking.window,
            soft_cap=masking.soft_cap,
            sinks=masking.sinks,
        )


def bidirectional_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start: list[int], scale: float
) -> torch.Tensor:
    """An encoder step's attention without the cache (the PyTorch path): q, k, v [T, H, D] hold whole
    prompts back to back (`query_start`: [B + 1] row offsets), each query seeing its prompt's every key.
    Prompts of one length share one SDPA call ([B, H, L, D]), on views of q, k and v where the step's
    prompts are all of that length (an embedding batch is mostly a few lengths), else on their rows gathered."""
    starts = query_start[:-1]
    lengths = [end - start for start, end in zip(starts, query_start[1:])]
    if len(set(lengths)) == 1:
        return _attend_same_length(q, k, v, len(starts), lengths[0], scale)
    out = torch.empty_like(q)
    by_length: dict[int, list[int]] = {}
    for start, length in zip(starts, lengths):
        by_length.setdefault(length, []).append(start)
    for length, firsts in by_length.items():
        rows = (torch.tensor(firsts)[:, None] + torch.arange(length)).flatten()
        qs, ks, vs = (t.index_select(0, rows) for t in (q, k, v))
        o = _attend_same_length(qs, ks, vs, len(firsts), length, scale)
        out.index_copy_(0, rows, o)
    return out


def _attend_same_length(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, length: int, scale: float
) -> torch.Tensor:
    """[B * L, H, D] rows of B prompts of L tokens each -> their bidirectional attention, [B * L, H, D]."""
    qb, kb, vb = (t.view(batch, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(qb, kb, vb, scale=scale).transpose(1, 2).reshape(q.shape)


def _first_block(first_query_pos: int, masking: Masking, block_size: int) -> int:
    """The first block holding a key that a query at first_query_pos or later may see."""
    first_key = masking.first_key(first_query_pos)
    return 0 if first_key is None else max(0, first_key) // block_size


def decode_plan(
    meta: AttentionMetadata, block_size: int, masking: Masking
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """Block ids to gather for the one-token queries (with a window, only the blocks it covers, from
    each sequence's own first one), the number of keys gathered per query, and which of them each
    query may see ([nd, 1, 1, S]; None when all are visible, which lets SDPA skip masking). MLA's
    PyTorch decode gathers its latent rows by the same plan (ember/ops/mla.py)."""
    nd = meta.num_decodes
    lens = meta.seq_lens_host[:nd]
    first = [_first_block(n - 1, masking, block_size) for n in lens]
    width = max(-(-n // block_size) - f for n, f in zip(lens, first))
    dev = meta.block_tables.device
    if not any(first):  # every row from its first block: a plain slice of the tables
        ids = meta.block_tables[:nd, :width].reshape(-1)
        keys = max(lens)
        if not masking.local and min(lens) == keys:
            return ids, keys, None
        offset: torch.Tensor | int = 0
    else:
        start = torch.tensor(first, device=dev)[:, None]
        # columns past a row's table can only hold keys past its length, which the mask hides
        cols = (start + torch.arange(width, device=dev)).clamp_(max=meta.block_tables.shape[1] - 1)
        ids = meta.block_tables[:nd].gather(1, cols).reshape(-1)
        keys = width * block_size
        offset = start * block_size
    pos = torch.arange(keys, device=dev)[None, :] + offset
    lens_t = meta.seq_lens[:nd, None]
    visible = pos < lens_t
    first_key = masking.first_key(lens_t - 1)
    if first_key is not None:
        visible &= pos >= first_key
    return ids, keys, visible[:, None, None, :]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    masking: Masking,
    causal: bool = False,
) -> torch.Tensor:
    """q [B, Hq, Q, D], k/v [B, Hk, S, D], mask broadcastable to [B, 1, Q, S] (True: visible).

    SDPA has neither soft cap nor sinks, so such a layer takes the explicit path, ordered as
    transformers' eager attention: scores, scale, cap, mask, the sink column, softmax in float32."""
    soft_cap, sinks = masking.soft_cap, masking.sinks
    if soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    b, hq, nq, d = q.shape
    hk = k.shape[1]
    q5 = q.view(b, hk, hq // hk, nq, d)  # query heads grouped by their KV head
    scores = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    if causal:
        mask = torch.ones(nq, k.shape[2], dtype=torch.bool, device=q.device).tril_()[None, None]
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sink = sinks.to(scores.dtype).view(1, hk, hq // hk, 1, 1).expand(b, -1, -1, nq, 1)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.amax(dim=-1, keepdim=True)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
    return torch.matmul(probs, v.unsqueeze(2)).view(b, hq, nq, d)
