"""Paged attention over a flat, unpadded batch, written with PyTorch ops (CPU, and CUDA fallback).

A batch holds `num_decodes` one-token queries first, then prefill chunks. New keys and values are
written into their cache slots, then every query attends to its sequence's cached context plus
itself, gathered through its block table. One-token queries are handled together with one padded
SDPA call; prefill chunks, few per step, one SDPA call each with a causal mask offset by the
chunk's cached context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64: cache slot of each new token
    num_decodes: int                # the first num_decodes sequences have exactly one query token
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64
    decode_seq_lens: torch.Tensor   # [num_decodes] int64: context length including the new token
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (query start, query len, seq len, block ids)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hk, D]; caches: [num_blocks, block_size, Hk, D]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. Keys/values for the new tokens must already be stored."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    nd = meta.num_decodes
    if nd:
        tables = meta.decode_block_tables
        max_len = tables.shape[1] * block_size
        k = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [nd, Hk, S, D]
        v = v_cache[tables].flatten(1, 2).transpose(1, 2)
        mask = torch.arange(max_len, device=q.device)[None, :] < meta.decode_seq_lens[:, None]
        o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                           scale=scale, enable_gqa=True)
        out[:nd] = o.squeeze(2)
    for start, q_len, seq_len, block_ids in meta.prefills:
        k = k_cache[block_ids].flatten(0, 1)[:seq_len].transpose(0, 1)  # [Hk, S, D]
        v = v_cache[block_ids].flatten(0, 1)[:seq_len].transpose(0, 1)
        qc = q[start:start + q_len].transpose(0, 1)  # [Hq, Q, D]
        ctx = seq_len - q_len
        if ctx == 0:
            o = F.scaled_dot_product_attention(qc, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            rows = torch.arange(q_len, device=q.device)[:, None] + ctx
            mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + q_len] = o.transpose(0, 1)
    return out
