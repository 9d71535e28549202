"""Paged attention over a flat, unpadded batch: Triton kernels on CUDA, PyTorch ops on CPU.

A batch holds `num_decodes` one-token queries first, then prefill chunks. New keys and values are
written into their cache slots, then every query attends to its sequence's cached context plus
itself, found through its block table. On CPU, one-token queries share one padded SDPA call and
each prefill chunk gets its own, with a causal mask offset by the chunk's cached context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ember.model.backend import use_triton


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64: cache slot of each new token (-1: padding, skipped)
    block_tables: torch.Tensor      # [B, W] int32, decode rows first, padded with 0
    seq_lens: torch.Tensor          # [B] int32: context length including the new tokens
    query_start_loc: torch.Tensor   # [B + 1] int32
    num_decodes: int                # the first num_decodes sequences have exactly one query token
    max_query_len: int              # longest prefill chunk (0 when there is none)
    max_seq_len: int                # longest context in the batch (sizes the decode kernel's split)
    seq_lens_host: list[int]        # the same values on the host, for the PyTorch path
    query_start_host: list[int]


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hk, D]; caches: [num_blocks, block_size, Hk, D]."""
    if use_triton(k):
        from ember.kernels import store_kv as store_kv_kernel

        store_kv_kernel(k, v, k_cache, v_cache, slot_mapping)
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. Keys/values for the new tokens must already be stored."""
    out = torch.empty_like(q)
    if use_triton(q):
        _triton_attention(q, k_cache, v_cache, meta, scale, out)
    else:
        _torch_attention(q, k_cache, v_cache, meta, scale, out)
    return out


def _triton_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, out: torch.Tensor) -> None:
    from ember.kernels import paged_decode_attention, paged_prefill_attention

    nd = meta.num_decodes
    if nd:
        paged_decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                               out=out[:nd], max_seq_len=meta.max_seq_len)
    if meta.max_query_len:
        # Prefill rows index the full q/out through their own query_start_loc entries.
        paged_prefill_attention(q, k_cache, v_cache, meta.block_tables[nd:], meta.seq_lens[nd:],
                                meta.query_start_loc[nd:], meta.max_query_len, scale, out=out)


def _torch_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, out: torch.Tensor) -> None:
    block_size = k_cache.shape[1]
    nd = meta.num_decodes
    if nd:
        width = -(-max(meta.seq_lens_host[:nd]) // block_size)
        tables = meta.block_tables[:nd, :width].long()
        k = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [nd, Hk, S, D]
        v = v_cache[tables].flatten(1, 2).transpose(1, 2)
        mask = torch.arange(width * block_size, device=q.device)[None, :] < meta.seq_lens[:nd, None]
        o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                           scale=scale, enable_gqa=True)
        out[:nd] = o.squeeze(2)
    for i in range(nd, len(meta.seq_lens_host)):
        start, end = meta.query_start_host[i], meta.query_start_host[i + 1]
        q_len, seq_len = end - start, meta.seq_lens_host[i]
        block_ids = meta.block_tables[i, : -(-seq_len // block_size)].long()
        k = k_cache[block_ids].flatten(0, 1)[:seq_len].transpose(0, 1)  # [Hk, S, D]
        v = v_cache[block_ids].flatten(0, 1)[:seq_len].transpose(0, 1)
        qc = q[start:end].transpose(0, 1)  # [Hq, Q, D]
        ctx = seq_len - q_len
        if ctx == 0:
            o = F.scaled_dot_product_attention(qc, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            rows = torch.arange(q_len, device=q.device)[:, None] + ctx
            mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
