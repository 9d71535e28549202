"""Ops called on tensors at hand, outside a model's layers (tests, benchmarks): each call asks the
registry for the tensors' device and dtype, so a FORCE_TRITON set just before applies. The model's
layers ask once and keep their implementations."""

from __future__ import annotations

import torch

from ember.ops import registry
from ember.ops.attention import AttentionMetadata, AttentionShape, Masking
from ember.quant.kv_scale import KVScale


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
    """k, v: [T, Hk, D]; caches: [num_blocks, block_size, Hk, D]; the scales as in `quantize_kv`."""
    impl = registry.attention_impl(registry.target(k.device, k.dtype), _shape(k.shape[1], k_cache))
    impl.store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    k_scale: KVScale = 1.0,
    v_scale: KVScale = 1.0,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. Keys/values for the new tokens must already be stored; fp8
    caches are read through their scales (see `dequantize_kv`).

    sliding_window: a query at position p sees only keys j with p - sliding_window < j <= p.
    logits_soft_cap: scaled scores s become cap * tanh(s / cap) before masking and softmax (Gemma 2).
    sinks: float32 [Hq], one logit per query head that joins every softmax denominator without a value
    (gpt-oss): out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)).
    attention_chunk: a query at position p sees only keys j of its own chunk, (p // C) * C <= j <= p (Llama 4)."""
    impl = registry.attention_impl(registry.target(q.device, q.dtype), _shape(q.shape[1], k_cache))
    masking = Masking(sliding_window, logits_soft_cap, sinks, chunk=attention_chunk)
    return impl(q, k_cache, v_cache, meta, scale, k_scale, v_scale, masking)


def _shape(num_heads: int, k_cache: torch.Tensor) -> AttentionShape:
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    return AttentionShape(k_cache.dtype, num_heads, num_kv_heads, head_dim, block_size)
